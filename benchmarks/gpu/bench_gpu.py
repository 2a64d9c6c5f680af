"""One-shot GPU measurement of the engine's kernels and of a Llama-3-8B-shaped model (random
bf16 weights), for a machine with torch + Triton but no Ray and no network: run once, read
the JSON.

  env       GPU, versions, peak bf16 FLOP/s (from the name, or --peak-tflops)
  copy      device copy bandwidth (bytes read + written / s): the denominator of "utilization"
  kernels   each Triton kernel on the GPU: max error against its torch reference (the same
            references the CPU tests use), time, and the torch path's time at the same shape
  quant_gemm  the quantized-weight GEMMs of issue 34 (FP8 with DeepSeek-V3's 128 x 128 block
            scales; FP8 x FP8 through torch._scaled_mm on compute capability >= 8.9; int4 AWQ, GPTQ
            and GPTQ act-order, group 128) against the torch matmul of the model's dtype, at M = 1
            / 16 / 256 / 4096 tokens × Llama-3-8B's 4096 x 4096 and 14336 x 4096 layers: time,
            TFLOP/s, GB/s (bytes of x, weight + its scales / zeros and y) from the time of a CUDA
            graph's replay (the eager call's time, launch included, beside it), and each kernel's
            error against x @ its own weight (read back as the product with the identity)
  fp8_kv_decode  paged decode attention (the triton kernel, one layer of the model's heads) over
            the FP8 KV cache (e4m3 rows + a scale byte, kv_cache/fp8.py) and over the bf16 cache
            holding the same values, at batch 1 / 4 / 16 / 64 × context 1K / 4K / 16K / 32K: time
            of a CUDA graph's replay (eager beside it), effective GB/s (the K/V bytes the context
            occupies / time) and its share of the copy bandwidth, FP8's speedup; the FP8 kernel's
            error against the reference and against the bf16 cache's output at the smallest cell
  decode    model decode step (forward + logits) at batch 1 / 16 / 64 / 256 × context 512 /
            2K / 8K: step time and bandwidth utilization = (weight bytes + KV bytes read) /
            step time / copy bandwidth; backends: triton replayed from a CUDA graph, triton
            eager, torch (gather + SDPA), flash_attn when it imports
  verify    a speculative verify step (issue 36): b sequences × (1 + k) query rows (the last
            token and k proposals) at 2K context through the triton backend (one prefill-kernel
            launch over the batch, logits for every row), k = 1..8 at batch 1 / 4 / 16 / 64,
            against the plain decode step (eager, the same batch and context): step time and the
            ratio verify / decode — the tokens a step must yield on average for speculation to
            pay, (1 − α^(k+1)) / (1 − α) ≥ ratio (sim/speculation.py)
  draft     an EAGLE-style draft head (engine/model/eagle.py: fc + one decoder layer of the model's
            shape, the model's embedding and LM head; random weights) at batch 1 / 4 / 16 / 64 ×
            2K context: its update after a decode step (one row per sequence through the triton
            backend, writing the draft layer's KV) and a chain of k = 2 / 4 / 8 proposals (the
            cached draft KV gathered once, k - 1 head steps over it, an argmax each;
            speculative/chain_attention.py), against the plain decode step (eager): what proposing
            costs per step, as a share of the step it saves
  prefill   one prompt of 512 / 2K / 8K tokens: time and MFU = (2 × non-embedding params ×
            tokens + causal attention FLOPs) / time / peak; triton vs torch SDPA (vs flash_attn)
  fused_ablation  decode (batch 64 × 2K) and a 2K prefill with the fused residual+RMSNorm and
            rotary kernels vs the torch ops: whether they matter
  streaming what publishing a streamed handoff's piece costs (issue 32) for one prefill chunk of
            512 / 2K tokens of this model's KV: the piece's checksum (kv_transfer/regions.py, on
            the device), its copy to pinned host memory (what tcp sends from) and device to device
            (a same-node peer), each also as a share of that chunk's prefill time when the
            prefill section measured one
  tp        the same model split over T = 2 and 4 GPUs (splitserve/engine/parallel: NCCL, one process
            per rank): decode step at batch 16 / 64 × 2K context and a 2K prefill; skipped with
            fewer GPUs than T (one H200 is the usual loan), run on CPU over gloo at T = 2 in --smoke

Every measurement is guarded: an error is recorded in the JSON and the run goes on, and a
section is skipped once --budget-s is spent, so one shot always leaves a result.

    python benchmarks/gpu/bench_gpu.py [--out results/gpu_bench.json] [--budget-s 480]
    python benchmarks/gpu/bench_gpu.py --smoke   # tiny shapes on CPU under TRITON_INTERPRET=1 (the test)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # runs from a checkout: no install on the GPU machine

# name fragment -> dense bf16 TFLOP/s (vendor figures for the SXM parts)
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}

LLAMA3_8B = dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256)
SMOKE = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.torch = torch
        self.smoke = args.smoke
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.dtype = torch.float32 if self.smoke else torch.bfloat16
        self.shape = SMOKE if self.smoke else LLAMA3_8B
        self.block_size = 16
        self.deadline = time.monotonic() + args.budget_s
        self.result: dict[str, Any] = {"smoke": self.smoke, "shape": self.shape, "errors": []}

    # -- plumbing -----------------------------------------------------------------------------
    def guarded(self, where: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # one shot: record, go on
            self.result["errors"].append({"where": where, "error": f"{type(e).__name__}: {e}",
                                          "trace": traceback.format_exc(limit=6)})
            print(f"[error] {where}: {type(e).__name__}: {e}", flush=True)
            return None

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def timeit(self, fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
        """Median seconds per call."""
        torch = self.torch
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if self.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    # -- sections -----------------------------------------------------------------------------
    def env(self) -> None:
        torch = self.torch
        import triton

        info: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__,
                                "python": platform.python_version(), "device": str(self.device)}
        peak = self.args.peak_tflops
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
            peak = peak or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in p.name), None)
        info["peak_bf16_tflops"] = peak
        self.peak_flops = peak * 1e12 if peak else None
        self.result["env"] = info
        print("env:", json.dumps(info), flush=True)

    def copy_bandwidth(self) -> None:
        torch = self.torch
        n = (1 << 20) if self.smoke else (2 << 30)  # elements of bf16: 4 GiB each way on the GPU
        src = torch.empty(n, dtype=self.dtype, device=self.device).normal_()
        dst = torch.empty_like(src)
        t = self.timeit(lambda: dst.copy_(src), iters=3 if self.smoke else 20)
        bw = 2 * src.numel() * src.element_size() / t
        self.copy_bw = bw
        self.result["copy"] = {"bytes_each_way": src.numel() * src.element_size(), "seconds": t, "gb_per_s": bw / 1e9}
        print(f"copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
        del src, dst

    def kernels(self) -> None:
        cases = KernelCases(self)
        out: dict[str, Any] = {}
        self.result["kernels"] = out
        for name in KernelCases.NAMES:
            out[name] = self.guarded(f"kernels.{name}", getattr(cases, name))
            print(f"kernel {name}: {out[name]}", flush=True)

    def quant_gemm(self) -> None:
        self.result["quant_gemm"] = QuantGemmCases(self).run()

    def fp8_kv_decode(self) -> None:
        self.result["fp8_kv_decode"] = Fp8KvDecodeCases(self).run()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()  # the section's caches, before the model's pool is sized

    def graph_seconds(self, fn: Callable[[], Any], iters: int) -> float:
        """The device's time for one call, replayed from a CUDA graph as a captured decode step
        runs it: without the Python launch, which for small work takes longer than the kernel."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm on a side stream, as capture wants
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.timeit(graph.replay, iters)

    # -- the model ----------------------------------------------------------------------------
    def build_model(self) -> None:
        torch = self.torch
        from splitserve.engine.model.llama import LlamaModel

        self.cfg = model_config(self.shape)
        t = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(self.device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                model = LlamaModel(self.cfg, self.cfg.max_position_embeddings).eval()
            finally:
                torch.set_default_dtype(prev)
        with torch.no_grad():
            for p in model.parameters():  # small weights keep bf16 activations finite over 32 layers
                p.normal_(0.0, 0.02)
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
        self.model = model
        if self.device.type == "cuda":  # as the engine does on CUDA, unless the kernels fail here
            self.result["fused_norm_rotary"] = self.guarded("model.fused", lambda: self._fuse(model)) or False
        params = sum(p.numel() for p in model.parameters())
        embed = model.embed_tokens.weight.numel()
        self.weight_bytes = (params - embed) * model.lm_head.weight.element_size()  # what a decode step reads
        # prefill computes logits for the last row only: the LM head counts once, not per token
        self.prefill_matmul_params = params - embed - model.lm_head.weight.numel()
        self.lm_head_params = model.lm_head.weight.numel()
        self.result["model"] = {"params": params, "weight_bytes_read_per_step": self.weight_bytes,
                                "build_seconds": round(time.perf_counter() - t, 1)}
        print(f"model: {params / 1e9:.2f} B params, built in {time.perf_counter() - t:.1f} s", flush=True)

    def _fuse(self, model) -> bool:
        from splitserve.engine.kernels import triton_norm

        x = self.torch.randn(4, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        triton_norm.rms_norm(x, model.norm.weight, 1e-5, residual=x)
        triton_norm.apply_rotary(x.view(4, -1, self.cfg.head_dim), *model.rotary(self.torch.arange(4, device=self.device),
                                                                                  self.dtype))
        model.use_triton_kernels()
        return True

    def allocate_kv(self, want_tokens: int) -> None:
        torch = self.torch
        c = self.cfg
        per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=self.dtype).element_size()
        tokens = want_tokens
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the copy test's buffers are cached, not free
            free, _ = torch.cuda.mem_get_info()
            tokens = min(want_tokens, int((free - (24 << 30)) // per_token))  # room for activations, gathers
        blocks = tokens // 256 * 256 // self.block_size  # a multiple of 256 tokens: flash_attn views it in 256-pages
        self.kv_storage = torch.zeros((c.num_layers, 2, blocks, self.block_size, c.num_kv_heads, c.head_dim),
                                      dtype=self.dtype, device=self.device)
        self.kv_bytes_per_token = per_token
        self.result["kv_pool"] = {"tokens": blocks * self.block_size,
                                  "bytes": self.kv_storage.numel() * self.kv_storage.element_size(),
                                  "wanted_tokens": want_tokens}
        print(f"kv pool: {blocks * self.block_size} tokens ({self.kv_storage.numel() * self.kv_storage.element_size() / 2**30:.1f} GiB)",
              flush=True)

    def layers(self, page: int):
        st = self.kv_storage
        if page == self.block_size:
            return [(st[i, 0], st[i, 1]) for i in range(st.shape[0])]
        # the same memory in larger pages (flash_attn)
        return [(st[i, 0].view(-1, page, *st.shape[4:]), st[i, 1].view(-1, page, *st.shape[4:]))
                for i in range(st.shape[0])]

    def batch(self, num_seqs: int, ctx: int, q_len: int, page: int):
        """An AttentionBatch of `num_seqs` sequences each with `ctx` tokens of which the last
        `q_len` are new, blocks drawn from a permutation of the pool (reused when the pool is
        smaller than the batch: then `shared` is set)."""
        torch = self.torch
        from splitserve.engine.attention.backend import AttentionBatch, SeqSlice

        pool = self.kv_storage.shape[2] * self.block_size // page
        per_seq = -(-ctx // page)
        g = torch.Generator().manual_seed(num_seqs * 7919 + ctx)
        perm = torch.randperm(pool, generator=g).tolist()
        slices, slots = [], []
        for s in range(num_seqs):
            blocks = tuple(perm[(s * per_seq + j) % pool] for j in range(per_seq))
            slices.append(SeqSlice(q_start=s * q_len, q_len=q_len, ctx_len=ctx, block_ids=blocks))
            slots += [blocks[p // page] * page + p % page for p in range(ctx - q_len, ctx)]
        decodes = tuple(slices) if q_len == 1 else ()
        prefills = () if q_len == 1 else tuple(slices)
        b = AttentionBatch(num_tokens=num_seqs * q_len, slot_mapping=torch.tensor(slots, device=self.device),
                           decodes=decodes, prefills=prefills, block_size=page)
        return b, num_seqs * per_seq > pool

    def backends(self):
        from splitserve.engine.attention.backend import get_backend

        names = ["triton", "torch"]
        if not self.smoke:
            try:
                import flash_attn  # noqa: F401
                names.append("flash_attn")
            except ImportError:
                self.result["flash_attn"] = "not installed"
        out = {}
        for n in names:
            page = 256 if n == "flash_attn" else self.block_size
            be = self.guarded(f"backend.{n}", lambda n=n, page=page: get_backend(
                n, self.dtype, self.device, block_size=page, head_dim=self.cfg.head_dim))
            if be is not None:
                out[n] = (be, page)
        return out

    def decode(self) -> None:
        torch = self.torch
        from splitserve.engine.decode_graphs import DecodeGraphs, cuda_graph_capture, eager_capture

        batches = (1, 2) if self.smoke else (1, 16, 64, 256)
        contexts = (16, 40) if self.smoke else (512, 2048, 8192)
        self.max_blocks = -(-(max(contexts) + 1) // self.block_size)  # the captured tables' width
        rows: list[dict] = []
        self.result["decode"] = rows
        iters = 2 if self.smoke else 10
        backends = self.backends()
        for b in batches:
            graphs = None
            if "triton" in backends:
                graphs = self.guarded(f"decode.capture.b{b}", lambda: self._capture(b, DecodeGraphs,
                                      eager_capture if self.smoke else cuda_graph_capture))
            for c in contexts:
                for name, (be, page) in backends.items():
                    for mode in ["graph", "eager"] if name == "triton" else ["eager"]:
                        rows.append(self._decode_cell(b, c, name, be, page, graphs if mode == "graph" else None,
                                                      mode, iters))
            del graphs
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _decode_cell(self, b: int, c: int, name: str, be, page: int, graphs, mode: str, iters: int) -> dict:
        row = {"batch": b, "context": c, "backend": name, "mode": mode}
        if self.time_left() < 60:
            return {**row, "skipped": "budget"}
        if mode == "graph" and graphs is None:
            return {**row, "skipped": "capture failed"}
        r = self.guarded(f"decode.{name}.{mode}.b{b}.c{c}", lambda: self._decode_row(b, c, be, page, graphs, iters))
        if r is None:
            return {**row, "skipped": "error"}
        print(f"decode b={b:3d} ctx={c:5d} {name:10s} {mode:5s} {r['step_ms']:8.2f} ms "
              f"util {r['bandwidth_util']:.2f}", flush=True)
        return {**r, **row}

    def _graph_splits(self, b: int) -> int:
        from splitserve.engine.kernels.triton_attention import decode_splits

        return decode_splits(b, self.cfg.num_kv_heads, self.max_blocks * self.block_size)

    def _capture(self, b: int, DecodeGraphs, capture):
        torch = self.torch
        from splitserve.engine.attention.paged_backends import TritonBackend

        be = TritonBackend(self.dtype, self.device)
        kv = self.layers(self.block_size)

        def forward(ids, pos, meta):
            return self.model(ids, pos, kv, be, meta)

        graphs = DecodeGraphs(forward, num_kv_heads=self.cfg.num_kv_heads, block_size=self.block_size,
                              max_blocks_per_seq=self.max_blocks, device=self.device, buckets=(b,))
        with torch.inference_mode():
            graphs.capture(capture)
        return graphs

    def _decode_row(self, b: int, c: int, be, page: int, graphs, iters: int) -> dict:
        """The forward + logits of one decode step, timed on the device; the host's per-step
        metadata build (`prepare`) is timed apart (it overlaps the GPU in a pipelined engine)."""
        torch = self.torch
        batch, shared = self.batch(b, c + 1, 1, page)  # c cached tokens + the new one
        kv = self.layers(page)
        ids = torch.randint(0, self.cfg.vocab_size, (b,), device=self.device)
        pos = torch.full((b,), c, dtype=torch.int64, device=self.device)
        t_prep = time.perf_counter()
        meta = be.prepare(batch)
        t_prep = time.perf_counter() - t_prep
        if be.name == "triton":
            # graph and eager rows at the same split count, so they differ only in launches
            meta.decode_splits = self._graph_splits(b)

        def step():
            hidden = graphs.run(ids, pos, meta) if graphs is not None else self.model(ids, pos, kv, be, meta)
            if hidden is None:
                raise RuntimeError(f"the graph of batch {b} did not replay")
            return self.model.compute_logits(hidden)

        with torch.inference_mode():
            t = self.timeit(step, iters)
        read = self.weight_bytes + b * (c + 1) * self.kv_bytes_per_token
        return {"batch": b, "context": c, "step_ms": t * 1e3, "prepare_ms": t_prep * 1e3, "bytes_read": read,
                "bandwidth_util": read / t / self.copy_bw, "tokens_per_s": b / t, "kv_blocks_shared": shared}

    def verify(self) -> None:
        be = self.backends().get("triton")
        rows: list[dict] = []
        self.result["verify"] = rows
        if be is None:
            return
        batches, ks = ((2,), (2,)) if self.smoke else ((1, 4, 16, 64), tuple(range(1, 9)))
        c, iters = (40, 1) if self.smoke else (2048, 10)
        for b in batches:
            if self.time_left() < 30:
                rows.append({"batch": b, "skipped": "budget"})
                continue
            decode = self.guarded(f"verify.decode.b{b}", lambda: self._step_s(b, c, 1, be[0], iters))
            for k in ks:
                verify = self.guarded(f"verify.b{b}.k{k}", lambda: self._step_s(b, c, k + 1, be[0], iters))
                if decode is None or verify is None:
                    rows.append({"batch": b, "k": k, "skipped": "error"})
                    continue
                rows.append({"batch": b, "k": k, "context": c, "decode_ms": decode * 1e3, "verify_ms": verify * 1e3,
                             "verify_over_decode": verify / decode})
                print(f"verify b={b:3d} k={k} decode {decode * 1e3:7.2f} ms verify {verify * 1e3:7.2f} ms "
                      f"x{verify / decode:.2f}", flush=True)

    def _step_s(self, b: int, c: int, q_len: int, be, iters: int) -> float:
        """Eager forward + logits of every new row: b sequences of c cached tokens + q_len new."""
        torch = self.torch
        batch, _ = self.batch(b, c + q_len, q_len, self.block_size)
        kv = self.layers(self.block_size)
        ids = torch.randint(0, self.cfg.vocab_size, (b * q_len,), device=self.device)
        pos = torch.arange(c, c + q_len, device=self.device).repeat(b)
        meta = be.prepare(batch)

        def step():
            return self.model.compute_logits(self.model(ids, pos, kv, be, meta))

        with torch.inference_mode():
            return self.timeit(step, iters, warmup=1 if self.smoke else 2)

    def draft(self) -> None:
        be = self.backends().get("triton")
        rows: list[dict] = []
        self.result["draft"] = rows
        if be is None:
            return
        head = self._eagle_head()
        batches, ks = ((2,), (2, 4)) if self.smoke else ((1, 4, 16, 64), (2, 4, 8))
        c, iters = (40, 1) if self.smoke else (2048, 10)
        for b in batches:
            if self.time_left() < 30:
                rows.append({"batch": b, "skipped": "budget"})
                continue
            decode = self.guarded(f"draft.decode.b{b}", lambda: self._step_s(b, c, 1, be[0], iters))
            update = self.guarded(f"draft.update.b{b}", lambda: self._draft_update_s(head, b, c, be[0], iters))
            for k in ks:
                chain = self.guarded(f"draft.chain.b{b}.k{k}", lambda: self._draft_chain_s(head, b, c, k, iters))
                if None in (decode, update, chain):
                    rows.append({"batch": b, "k": k, "skipped": "error"})
                    continue
                rows.append({"batch": b, "k": k, "context": c, "decode_ms": decode * 1e3, "update_ms": update * 1e3,
                             "chain_ms": chain * 1e3, "draft_over_decode": (update + chain) / decode})
                print(f"draft b={b:3d} k={k} decode {decode * 1e3:7.2f} ms update {update * 1e3:6.2f} ms "
                      f"chain {chain * 1e3:6.2f} ms x{(update + chain) / decode:.2f}", flush=True)

    def _eagle_head(self):
        """The head of an EAGLE checkpoint for this model, random weights, sharing its embedding
        and LM head (as EAGLE-1's releases do)."""
        import dataclasses

        torch = self.torch
        from splitserve.engine.model.eagle import EagleHead

        cfg = dataclasses.replace(self.cfg, num_layers=1)
        with torch.device(self.device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                head = EagleHead(cfg, self.model, cfg.max_position_embeddings, own_embedding=False,
                                 own_lm_head=False, fc_bias=False, input_norm=False).eval()
            finally:
                torch.set_default_dtype(prev)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
        return head

    def _draft_update_s(self, head, b: int, c: int, be, iters: int) -> float:
        """The head over one row per sequence (its last position), its KV written into a layer
        of the pool (the draft layer's stand-in), and the argmax of each row's guess."""
        torch = self.torch
        batch, _ = self.batch(b, c + 1, 1, self.block_size)
        kv = self.layers(self.block_size)[0]
        ids = torch.randint(0, self.cfg.vocab_size, (b,), device=self.device)
        pos = torch.full((b,), c, dtype=torch.int64, device=self.device)
        hidden = torch.randn(b, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        meta = be.prepare(batch)

        def step():
            cos, sin = head.rotary(pos, hidden.dtype)
            out = head(ids, self.model.norm(hidden), cos, sin, kv, be, meta)
            return head.logits(out).argmax(-1)

        with torch.inference_mode():
            return self.timeit(step, iters, warmup=1 if self.smoke else 2)

    def _draft_chain_s(self, head, b: int, c: int, k: int, iters: int) -> float:
        """k - 1 chain steps for b sequences of c cached draft positions (the tail's token is the
        first proposal, made by the update): the gather of the cached draft KV included."""
        torch = self.torch
        from splitserve.engine.attention.torch_backend import TorchBackend
        from splitserve.engine.speculative.chain_attention import ChainAttention

        batch, _ = self.batch(b, c, 1, self.block_size)
        tables = [list(s.block_ids) for s in batch.decodes]
        kv = self.layers(self.block_size)[0]
        reader = TorchBackend(self.dtype)
        feat0 = torch.randn(b, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        tok0 = torch.randint(0, self.cfg.vocab_size, (b,), device=self.device)

        def chain():
            attn = ChainAttention(reader, kv, tables, [c] * b, self.device, self.dtype)
            feat, tok, pos = feat0, tok0, torch.full((b,), c - 1, dtype=torch.int64, device=self.device)
            for _ in range(k - 1):
                pos = pos + 1
                cos, sin = head.rotary(pos, feat.dtype)
                feat = head(tok, feat, cos, sin, kv, attn, None)
                tok = head.logits(feat).argmax(-1)
            return tok

        with torch.inference_mode():
            return self.timeit(chain, iters, warmup=1 if self.smoke else 2)

    def prefill(self) -> None:
        lengths = (16, 32) if self.smoke else (512, 2048, 8192)
        rows: list[dict] = []
        self.result["prefill"] = rows
        iters = 2 if self.smoke else 5
        backends = self.backends()
        for T in lengths:
            for name, (be, page) in backends.items():
                if self.time_left() < 30:
                    rows.append({"tokens": T, "backend": name, "skipped": "budget"})
                    continue
                r = self.guarded(f"prefill.{name}.{T}", lambda: self._prefill_row(T, be, page, iters))
                if r is None:
                    rows.append({"tokens": T, "backend": name, "skipped": "error"})
                    continue
                rows.append({**r, "backend": name})
                print(f"prefill T={T:5d} {name:10s} {r['seconds'] * 1e3:8.1f} ms {r['tflops']:.1f} TFLOP/s "
                      f"MFU {r['mfu']}", flush=True)

    def _prefill_row(self, T: int, be, page: int, iters: int) -> dict:
        """One prompt of T tokens through the model (logits for its last row), timed on the device."""
        torch, c = self.torch, self.cfg
        batch, _ = self.batch(1, T, T, page)
        kv = self.layers(page)
        ids = torch.randint(0, c.vocab_size, (T,), device=self.device)
        pos = torch.arange(T, device=self.device)
        meta = be.prepare(batch)

        def step():
            return self.model.compute_logits(self.model(ids, pos, kv, be, meta)[-1:])

        with torch.inference_mode():
            t = self.timeit(step, iters)
        attn = 2 * T * T * c.num_heads * c.head_dim * c.num_layers  # causal QK^T + PV
        flops = 2 * self.prefill_matmul_params * T + 2 * self.lm_head_params + attn
        return {"tokens": T, "seconds": t, "tflops": flops / t / 1e12,
                "mfu": flops / t / self.peak_flops if self.peak_flops else None}

    def fused_ablation(self) -> None:
        """What the fused residual+RMSNorm and rotary kernels buy in the model: decode at batch
        64 × 2K and a 2K prefill, triton eager (no graph, so launch savings count), fused vs
        torch ops."""
        if not self.result.get("fused_norm_rotary") and not self.smoke:
            return
        triton = self.backends().get("triton")
        if triton is None:
            return
        be, page = triton
        b, c, T = (2, 40, 32) if self.smoke else (64, 2048, 2048)
        rows = self.result["fused_ablation"] = []
        for fused in (True, False):
            self.model.use_triton_kernels(fused)
            dec = self.guarded(f"ablation.decode.{fused}", lambda: self._decode_row(b, c, be, page, None, 5))
            pre = self.guarded(f"ablation.prefill.{fused}", lambda: self._prefill_row(T, be, page, 3))
            rows.append({"fused": fused, "decode_step_ms": dec and dec["step_ms"],
                         "prefill_ms": pre and pre["seconds"] * 1e3})
            print(f"fused={fused}: {rows[-1]}", flush=True)
        self.model.use_triton_kernels(self.device.type == "cuda" and bool(self.result.get("fused_norm_rotary")))

    def host_tier(self) -> None:
        """The host-memory KV tier (engine/kv_cache/host_tier.py) against this device pool: GB/s
        of saving evicted blocks to pinned host memory and of promoting them back on a prefix hit,
        and that a promoted block is bit-identical to what was evicted."""
        torch = self.torch
        from splitserve.engine.kv_cache import BlockPool, HostTier

        storage = self.kv_storage
        n = min(storage.shape[2] // 2, 8 if self.smoke else 256)
        pool, tier = BlockPool(storage.shape[2], self.block_size), HostTier(n, storage)
        hashes = [i.to_bytes(16, "little") for i in range(n)]
        blocks = pool.allocate(n)
        pool.cache_blocks(blocks, hashes)
        pool.free(blocks)
        idx = torch.tensor(blocks, device=storage.device)
        ref = storage.index_select(2, idx).clone()
        sync = torch.cuda.synchronize if storage.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for b, h in zip(blocks, hashes):
            tier.save(b, h)
        sync()
        t1 = time.perf_counter()
        pool.reset_prefix_cache()
        storage.index_fill_(2, idx, 0)  # the device copies are gone: only the tier has them
        sync()
        t2 = time.perf_counter()
        got = tier.promote(pool, (), hashes)
        sync()
        t3 = time.perf_counter()
        nbytes = ref.numel() * ref.element_size()
        exact = len(got) == n and torch.equal(storage.index_select(2, torch.tensor(got, device=storage.device)), ref)
        self.result["host_tier"] = {"blocks": n, "bytes": nbytes, "save_gb_per_s": nbytes / (t1 - t0) / 1e9,
                                    "promote_gb_per_s": nbytes / (t3 - t2) / 1e9, "exact": bool(exact)}
        print("host tier:", json.dumps(self.result["host_tier"]), flush=True)
        del ref

    def streaming(self) -> None:
        """Per prefill chunk: the piece's checksum and copies, against the chunk's prefill time."""
        torch = self.torch
        from splitserve.kv_transfer.base import KVLayout
        from splitserve.kv_transfer.regions import kv_checksum

        storage = self.kv_storage
        L, _, nb, bs, h, d = storage.shape
        layout = KVLayout(L, nb, bs, h, d, str(storage.dtype).removeprefix("torch."), storage.element_size(), "bench")
        prefill_s = {r["tokens"]: r["seconds"] for r in self.result.get("prefill", [])
                     if r.get("backend") == "triton" and "seconds" in r}
        sync = torch.cuda.synchronize if storage.device.type == "cuda" else (lambda: None)
        rows = []
        for tokens in ((32, 64) if self.smoke else (512, 2048)):
            n = min(tokens // self.block_size, storage.shape[2])
            blocks = list(range(n))
            idx = torch.tensor(blocks, device=storage.device)
            piece = storage.index_select(2, idx)
            host = torch.empty(piece.shape, dtype=piece.dtype, pin_memory=storage.device.type == "cuda")
            peer = torch.empty_like(piece)
            nbytes = piece.numel() * piece.element_size()
            iters = 3 if self.smoke else 20
            checksum_s = self.timeit(lambda: kv_checksum(storage, layout, blocks), iters)
            d2h_s = self.timeit(lambda: (host.copy_(piece, non_blocking=True), sync()), iters)
            d2d_s = self.timeit(lambda: (peer.copy_(piece), sync()), iters)
            row = {"tokens": n * self.block_size, "bytes": nbytes, "checksum_s": checksum_s,
                   "to_pinned_host_gb_per_s": nbytes / d2h_s / 1e9, "device_to_device_gb_per_s": nbytes / d2d_s / 1e9}
            chunk_s = prefill_s.get(tokens)
            if chunk_s:
                row["checksum_share_of_chunk_prefill"] = checksum_s / chunk_s
                row["to_host_share_of_chunk_prefill"] = d2h_s / chunk_s
            rows.append(row)
            print("streaming:", json.dumps(row), flush=True)
        self.result["streaming"] = rows

    def summary(self) -> dict:
        """The issue's two goals, read off the rows."""
        out: dict[str, Any] = {}
        for r in self.result.get("decode", []):
            if (r.get("batch"), r.get("context"), r.get("backend"), r.get("mode")) == (64, 2048, "triton", "graph"):
                out["decode_util_b64_ctx2k"] = r["bandwidth_util"]
        for r in self.result.get("prefill", []):
            if (r.get("tokens"), r.get("backend")) == (8192, "triton"):
                out["prefill_mfu_8k"] = r.get("mfu")
        for r in self.result.get("verify", []):
            if (r.get("batch"), r.get("k")) == (16, 4) and "verify_over_decode" in r:
                out["verify_over_decode_b16_k4"] = r["verify_over_decode"]
        for r in self.result.get("draft", []):
            if (r.get("batch"), r.get("k")) == (16, 4) and "draft_over_decode" in r:
                out["draft_over_decode_b16_k4"] = r["draft_over_decode"]
        for r in self.result.get("fp8_kv_decode", []):
            if (r.get("batch"), r.get("context")) == (64, 32768) and "speedup_vs_plain" in r:
                out["fp8_kv_decode_speedup_b64_ctx32k"] = r["speedup_vs_plain"]
        return out


class KernelCases:
    """Each Triton kernel at a serving-sized shape: its error against the torch reference, its
    time, and the torch path's time for the same work."""

    NAMES = ("decode", "prefill", "store_kv", "pack_blocks", "rms_norm_residual", "rotary")

    def __init__(self, bench: Bench) -> None:
        from splitserve.engine.kernels import triton_attention, triton_kv, triton_norm

        self.att, self.kv, self.norm = triton_attention, triton_kv, triton_norm
        self.bench, self.torch = bench, bench.torch
        s = bench.shape
        self.hkv, self.d, self.h, self.hidden = s["kv_heads"], s["head_dim"], s["heads"], s["hidden"]
        self.bs, self.dev, self.dt = bench.block_size, bench.device, bench.dtype
        self.g = self.torch.Generator(device=self.dev).manual_seed(0)
        self.iters = 2 if bench.smoke else 50
        self.batch, self.ctx = (4, 40) if bench.smoke else (64, 2048)
        nblk = -(-self.ctx // self.bs)
        self.k_cache = self.rand(self.batch * nblk + 1, self.bs, self.hkv, self.d)
        self.v_cache = self.rand(self.batch * nblk + 1, self.bs, self.hkv, self.d)
        perm = self.torch.randperm(self.batch * nblk, device=self.dev, generator=self.g)
        self.tables = perm.to(self.torch.int32).view(self.batch, nblk)

    def rand(self, *shape):
        return self.torch.randn(*shape, generator=self.g, device=self.dev, dtype=self.torch.float32).to(self.dt)

    def _times(self, ours: Callable[[], Any], theirs: Callable[[], Any]) -> tuple[float, float]:
        return self.bench.timeit(ours, self.iters), self.bench.timeit(theirs, self.iters)

    def decode(self) -> dict:
        att, d, torch = self.att, self.d, self.torch
        q = self.rand(self.batch, self.h, d)
        lens = torch.full((self.batch,), self.ctx, dtype=torch.int32, device=self.dev)
        args = (q, self.k_cache, self.v_cache, self.tables, lens, d ** -0.5)
        err = _err(att.paged_attention_decode(*args), att.paged_attention_decode_reference(*args))
        t, t_torch = self._times(lambda: att.paged_attention_decode(*args, validate=False),
                                 lambda: _gather_sdpa_decode(torch, q, self.k_cache, self.v_cache, self.tables, self.ctx,
                                                             d ** -0.5))
        kv_bytes = 2 * self.batch * self.ctx * self.hkv * d * self.k_cache.element_size()
        return {"batch": self.batch, "context": self.ctx, "max_abs_err": err, "seconds": t,
                "bandwidth_util": kv_bytes / t / self.bench.copy_bw, "torch_gather_sdpa_seconds": t_torch}

    def prefill(self) -> dict:
        att, d, h, hkv, torch = self.att, self.d, self.h, self.hkv, self.torch
        T = 32 if self.bench.smoke else 4096
        blocks = -(-T // self.bs)
        kc, vc = self.rand(blocks, self.bs, hkv, d), self.rand(blocks, self.bs, hkv, d)
        tab = torch.arange(blocks, dtype=torch.int32, device=self.dev)[None]
        cu = torch.tensor([0, T], dtype=torch.int32, device=self.dev)
        ln = torch.tensor([T], dtype=torch.int32, device=self.dev)
        q = self.rand(T, h, d)
        args = (q, kc, vc, tab, cu, ln, d ** -0.5)
        err = _err(att.paged_attention_prefill(*args), att.paged_attention_prefill_reference(*args))
        k = kc.view(-1, hkv, d)[:T].transpose(0, 1)[None].repeat_interleave(h // hkv, dim=1)
        v = vc.view(-1, hkv, d)[:T].transpose(0, 1)[None].repeat_interleave(h // hkv, dim=1)
        qt = q.transpose(0, 1)[None]
        t, t_sdpa = self._times(lambda: att.paged_attention_prefill(*args, max_seqlen_q=T, validate=False),
                                lambda: torch.nn.functional.scaled_dot_product_attention(qt, k, v, is_causal=True))
        flops = 2 * T * T * h * d  # QK^T and PV, causal half of 2 * 2 * T^2 * h * d
        return {"tokens": T, "max_abs_err": err, "seconds": t, "tflops": flops / t / 1e12,
                "torch_sdpa_seconds": t_sdpa, "torch_sdpa_tflops": flops / t_sdpa / 1e12}

    def store_kv(self) -> dict:
        kv, torch = self.kv, self.torch
        n = 64 if self.bench.smoke else 8192
        key, val = self.rand(n, self.hkv, self.d), self.rand(n, self.hkv, self.d)
        slots = torch.randperm(self.k_cache.shape[0] * self.bs, device=self.dev, generator=self.g)[:n]
        kc, vc, kr, vr = (self.k_cache.clone() for _ in range(4))
        kv.store_kv(key, val, kc, vc, slots)
        kv.store_kv_reference(key, val, kr, vr, slots)
        t, t_torch = self._times(lambda: kv.store_kv(key, val, kc, vc, slots),
                                 lambda: kv.store_kv_reference(key, val, kr, vr, slots))
        return {"tokens": n, "exact": bool(torch.equal(kc, kr) and torch.equal(vc, vr)), "seconds": t,
                "gb_per_s": 4 * key.numel() * key.element_size() / t / 1e9, "torch_seconds": t_torch}

    def pack_blocks(self) -> dict:
        kv = self.kv
        layers = 2 if self.bench.smoke else 32
        ks, vs, ids = [self.k_cache] * layers, [self.v_cache] * layers, self.tables[0].long()
        buf = kv.pack_blocks(ks, vs, ids)
        exact = bool(self.torch.equal(buf, kv.pack_blocks_reference(ks, vs, ids)))
        t, t_torch = self._times(lambda: kv.pack_blocks(ks, vs, ids), lambda: kv.pack_blocks_reference(ks, vs, ids))
        return {"layers": layers, "blocks": int(ids.numel()), "exact": exact, "seconds": t,
                "gb_per_s": 2 * buf.numel() * buf.element_size() / t / 1e9, "torch_seconds": t_torch}

    def rms_norm_residual(self) -> dict:
        norm = self.norm
        n = 8 if self.bench.smoke else 256
        x, r, w = self.rand(n, self.hidden), self.rand(n, self.hidden), self.rand(self.hidden)
        (o, nr), (ro, rr) = norm.rms_norm(x, w, 1e-5, residual=r), norm.rms_norm_reference(x, w, 1e-5, residual=r)
        t, t_torch = self._times(lambda: norm.rms_norm(x, w, 1e-5, residual=r),
                                 lambda: norm.rms_norm_reference(x, w, 1e-5, residual=r))
        return {"tokens": n, "max_abs_err": max(_err(o, ro), _err(nr, rr)), "seconds": t, "torch_seconds": t_torch}

    def rotary(self) -> dict:
        norm = self.norm
        n = 8 if self.bench.smoke else 256
        qk, cos, sin = self.rand(n, self.h + self.hkv, self.d), self.rand(n, 1, self.d), self.rand(n, 1, self.d)
        err = _err(norm.apply_rotary(qk, cos, sin), norm.apply_rotary_reference(qk, cos, sin))
        t, t_torch = self._times(lambda: norm.apply_rotary(qk, cos, sin),
                                 lambda: norm.apply_rotary_reference(qk, cos, sin))
        return {"tokens": n, "max_abs_err": err, "seconds": t, "torch_seconds": t_torch}


class QuantGemmCases:
    """Each quantized-weight GEMM (splitserve/engine/kernels/triton_fp8_gemm.py,
    triton_int4_gemm.py) and the torch matmul at decode and prefill token counts. Weights are
    random bits with random scales: the timing does not depend on the values, and the error
    compares a kernel with itself at another tile shape (the identity's product reads back the
    weight the kernel applies); the formats' meaning is what tests/kernels checks."""

    SHAPES = ((4096, 4096), (14336, 4096))  # (N, K): Llama-3-8B's q / o projections, gate / up
    TOKENS = (1, 16, 256, 4096)

    def __init__(self, bench: Bench) -> None:
        from splitserve.engine.kernels import triton_fp8_gemm, triton_int4_gemm

        self.fp8, self.int4 = triton_fp8_gemm, triton_int4_gemm
        self.bench, self.torch = bench, bench.torch
        self.dev, self.dt = bench.device, bench.dtype
        self.g = self.torch.Generator(device=self.dev).manual_seed(0)
        self.shapes = ((64, 128), (96, 256)) if bench.smoke else self.SHAPES
        self.tokens = (1, 16) if bench.smoke else self.TOKENS
        self.iters = 2 if bench.smoke else 20

    def run(self) -> list[dict]:
        rows: list[dict] = []
        for n, k in self.shapes:
            methods = self.bench.guarded(f"quant_gemm.weights.{n}x{k}", lambda: self.methods(n, k)) or {}
            for name, (fn, weight_bytes) in methods.items():
                w_eff = self.bench.guarded(f"quant_gemm.{name}.{n}x{k}.readback", lambda: self._readback(fn, k))
                for m in self.tokens:
                    row = {"method": name, "m": m, "n": n, "k": k}
                    if self.bench.time_left() < 30 or w_eff is None:
                        rows.append({**row, "skipped": "budget" if w_eff is not None else "error"})
                        continue
                    r = self.bench.guarded(f"quant_gemm.{name}.m{m}.{n}x{k}",
                                           lambda: self._row(fn, w_eff, m, n, k, weight_bytes))
                    rows.append({**row, **r} if r else {**row, "skipped": "error"})
                del w_eff
        self._speedups(rows)
        for r in rows:
            if "seconds" in r:
                print(f"quant_gemm {r['method']:19s} m={r['m']:5d} {r['n']:5d}x{r['k']} {r['seconds'] * 1e6:8.1f} us "
                      f"(eager {r['eager_seconds'] * 1e6:8.1f}) {r['tflops']:6.1f} TFLOP/s {r['gb_per_s']:7.0f} GB/s "
                      f"x{r['speedup_vs_torch']:.2f} err {r['max_rel_err']:.1e}", flush=True)
        return rows

    def methods(self, n: int, k: int) -> dict[str, tuple[Callable, int]]:
        """name -> (x -> x @ W^T-or-W, bytes of the weight with its scales and zeros)."""
        torch, fp8, int4, dev = self.torch, self.fp8, self.int4, self.dev
        w = (torch.randn(n, k, generator=self.g, device=dev) * 0.02).to(self.dt)
        w8 = torch.randn(n, k, generator=self.g, device=dev).to(torch.float8_e4m3fn)
        blocks = torch.rand(-(-n // 128), -(-k // 128), generator=self.g, device=dev) * 0.01
        out = {"torch": (lambda x: x @ w.t(), w.numel() * w.element_size()),
               "fp8_block128": (lambda x: fp8.fp8_gemm(x, w8, blocks, block_size=(128, 128)),
                                w8.numel() + 4 * blocks.numel())}
        if dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9):
            s1 = torch.tensor(0.01, device=dev)
            out["fp8_scaled_mm"] = (lambda x: fp8.fp8_gemm(x, w8, s1, quantize_activations=True), w8.numel() + 4)
        groups = k // 128

        def words(*shape):  # random int32 words: eight random nibbles each
            return torch.randint(-2**31, 2**31, shape, generator=self.g, device=dev, dtype=torch.int32)

        scales = torch.rand(groups, n, generator=self.g, device=dev).to(torch.float16) * 0.01
        zeros = words(groups, n // 8)
        int4_bytes = n * k // 2 + 2 * scales.numel() + 4 * zeros.numel()
        awq_w, gptq_w = words(k, n // 8), words(k // 8, n)
        perm = torch.randperm(k, generator=self.g, device=dev)
        g_idx = torch.empty(k, dtype=torch.int32, device=dev)
        g_idx[perm] = (torch.arange(k, device=dev) // 128).to(torch.int32)  # act-order: groups permuted
        gptq = dict(group_size=128, sym=False, checkpoint_format="gptq")
        out["awq_g128"] = (lambda x: int4.awq_gemm(x, awq_w, zeros, scales, 128), int4_bytes)
        out["gptq_g128"] = (lambda x: int4.gptq_gemm(x, gptq_w, zeros, scales, **gptq), int4_bytes)
        out["gptq_g128_act_order"] = (lambda x: int4.gptq_gemm(x, gptq_w, zeros, scales, g_idx, validate=False, **gptq),
                                      int4_bytes + 4 * k)
        return out

    def _readback(self, fn: Callable, k: int):
        """The [K, N] weight `fn` applies: its product with the identity (exact for every kernel here)."""
        return fn(self.torch.eye(k, device=self.dev, dtype=self.dt))

    def _row(self, fn: Callable, w_eff, m: int, n: int, k: int, weight_bytes: int) -> dict:
        x = self.torch.randn(m, k, generator=self.g, device=self.dev).to(self.dt)
        ref = (x.float() @ w_eff.float())
        err = float((fn(x).float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
        eager = self.bench.timeit(lambda: fn(x), self.iters)
        t = self.bench.graph_seconds(lambda: fn(x), self.iters) if self.dev.type == "cuda" else eager
        moved = weight_bytes + (m * k + m * n) * x.element_size()
        return {"seconds": t, "eager_seconds": eager, "tflops": 2 * m * n * k / t / 1e12, "gb_per_s": moved / t / 1e9,
                "bytes": moved, "max_rel_err": err}

    @staticmethod
    def _speedups(rows: list[dict]) -> None:
        base = {(r["m"], r["n"], r["k"]): r["seconds"] for r in rows if r["method"] == "torch" and "seconds" in r}
        for r in rows:
            if "seconds" in r and (r["m"], r["n"], r["k"]) in base:
                r["speedup_vs_torch"] = base[(r["m"], r["n"], r["k"])] / r["seconds"]
            elif "seconds" in r:
                r["speedup_vs_torch"] = float("nan")


class Fp8KvDecodeCases:
    """Paged decode attention (triton_attention.paged_attention_decode, default splits, as the
    engine launches it) over one layer's cache in two forms holding the same values: the model
    dtype's, and FP8 (kv_cache/fp8.py: head_dim e4m3 bytes + one exponent byte a row: 129 bytes
    against bf16's 256 at head_dim 128). Decode attention reads each context token's K and
    V once, so its time is the cache bytes over the bandwidth it reaches: GB/s below counts the
    K/V bytes the batch's contexts occupy (q, the output and the block tables are < 0.1%)."""

    BATCHES = (1, 4, 16, 64)
    CONTEXTS = (1024, 4096, 16384, 32768)

    def __init__(self, bench: Bench) -> None:
        from splitserve.engine.kernels import triton_attention
        from splitserve.engine.kv_cache import fp8 as kv_fp8

        self.att, self.kv_fp8 = triton_attention, kv_fp8
        self.bench, self.torch = bench, bench.torch
        s = bench.shape
        self.h, self.hkv, self.d = s["heads"], s["kv_heads"], s["head_dim"]
        self.bs, self.dev, self.dt = bench.block_size, bench.device, bench.dtype
        self.plain_name = str(self.dt).removeprefix("torch.")
        self.batches = (1, 2) if bench.smoke else self.BATCHES
        self.contexts = (16, 40) if bench.smoke else self.CONTEXTS
        self.iters = 2 if bench.smoke else 20
        self.g = self.torch.Generator(device=self.dev).manual_seed(0)

    def run(self) -> list[dict]:
        from splitserve.engine.attention.paged_backends import triton_fp8_unavailable

        why_not = triton_fp8_unavailable(self.dev)
        if why_not:
            return [{"skipped": why_not}]
        caches = self.bench.guarded("fp8_kv_decode.caches", self._caches)
        if caches is None:
            return [{"skipped": "error"}]
        rows: list[dict] = []
        for b in self.batches:
            for c in self.contexts:
                cell = {}
                for name, (k, v) in caches.items():
                    row = {"batch": b, "context": c, "kv_dtype": name}
                    if self.bench.time_left() < 30:
                        rows.append({**row, "skipped": "budget"})
                        continue
                    r = self.bench.guarded(f"fp8_kv_decode.{name}.b{b}.c{c}", lambda: self._row(b, c, k, v, caches))
                    rows.append({**row, **r} if r else {**row, "skipped": "error"})
                    cell[name] = rows[-1].get("seconds")
                plain, fp8 = cell.get(self.plain_name), cell.get(self.kv_fp8.NAME)
                if plain and fp8:
                    rows[-1]["speedup_vs_plain"] = plain / fp8
        for r in rows:
            if "seconds" in r:
                print(f"fp8_kv_decode {r['kv_dtype']:9s} b={r['batch']:3d} ctx={r['context']:6d} "
                      f"{r['seconds'] * 1e6:9.1f} us (eager {r['eager_seconds'] * 1e6:9.1f}) {r['gb_per_s']:7.0f} GB/s"
                      + (f" x{r['speedup_vs_plain']:.2f}" if "speedup_vs_plain" in r else ""), flush=True)
        return rows

    def _caches(self) -> dict:
        """{kv dtype name: (K, V)}: random values in the model dtype, and the same values encoded
        (in slices: encode's temporaries are fp32)."""
        torch, kv_fp8 = self.torch, self.kv_fp8
        blocks = max(self.batches) * -(-max(self.contexts) // self.bs)
        shape = (blocks, self.bs, self.hkv, self.d)
        plain = [torch.randn(shape, generator=self.g, device=self.dev, dtype=torch.float32).to(self.dt)
                 for _ in range(2)]
        fp8 = [torch.empty((*shape[:3], kv_fp8.row_bytes(self.d)), dtype=kv_fp8.STORAGE_DTYPE, device=self.dev)
               for _ in range(2)]
        for x, rows in zip(plain, fp8):
            for i in range(0, blocks, 4096):
                rows[i:i + 4096] = kv_fp8.encode(x[i:i + 4096])
        return {self.plain_name: tuple(plain), kv_fp8.NAME: tuple(fp8)}

    def _row(self, b: int, c: int, k, v, caches: dict) -> dict:
        torch, att = self.torch, self.att
        per_seq = -(-c // self.bs)
        perm = torch.randperm(k.shape[0], generator=self.g, device=self.dev)[: b * per_seq]
        tables = perm.to(torch.int32).view(b, per_seq)
        lens = torch.full((b,), c, dtype=torch.int32, device=self.dev)
        q = torch.randn(b, self.h, self.d, generator=self.g, device=self.dev, dtype=torch.float32).to(self.dt)
        out = torch.empty_like(q)
        scale = self.d ** -0.5

        def fn():
            att.paged_attention_decode(q, k, v, tables, lens, scale, out=out, validate=False)

        eager = self.bench.timeit(fn, self.iters)
        t = self.bench.graph_seconds(fn, self.iters) if self.dev.type == "cuda" else eager
        row_bytes = k.shape[-1] * k.element_size()
        moved = 2 * b * c * self.hkv * row_bytes
        r = {"seconds": t, "eager_seconds": eager, "bytes": moved, "gb_per_s": moved / t / 1e9,
             "bandwidth_util": moved / t / self.bench.copy_bw}
        if (b, c) == (self.batches[0], self.contexts[0]):  # errors once: the reference gathers in Python
            fn()
            r["max_abs_err"] = _err(out, att.paged_attention_decode_reference(q, k, v, tables, lens, scale))
            if k.dtype == self.kv_fp8.STORAGE_DTYPE:
                pk, pv = caches[self.plain_name]
                r["vs_plain_max_abs_err"] = _err(out, att.paged_attention_decode(q, pk, pv, tables, lens, scale))
        return r


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _gather_sdpa_decode(torch, q, k_cache, v_cache, tables, ctx, scale):
    """The torch path: gather every sequence's blocks, SDPA with GQA groups (as TorchBackend)."""
    n, h, d = q.shape
    hkv = k_cache.shape[2]
    idx = tables.long().reshape(-1)
    k = k_cache.index_select(0, idx).view(n, -1, hkv, d)[:, :ctx].transpose(1, 2)
    v = v_cache.index_select(0, idx).view(n, -1, hkv, d)[:, :ctx].transpose(1, 2)
    qg = q.view(n, hkv, h // hkv, d)
    return torch.nn.functional.scaled_dot_product_attention(qg, k, v, scale=scale)


def model_config(s: dict):
    from splitserve.engine.model.config import ModelConfig, RopeConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=s["vocab"], hidden_size=s["hidden"],
        intermediate_size=s["inter"], num_layers=s["layers"], num_heads=s["heads"], num_kv_heads=s["kv_heads"],
        head_dim=s["head_dim"], rms_norm_eps=1e-5, max_position_embeddings=8192 + 64,
        rope=RopeConfig(theta=500000.0), qkv_bias=False, o_bias=False, qk_norm=False, tie_word_embeddings=False,
        sliding_window=None, bos_token_id=None, eos_token_ids=(), torch_dtype="bfloat16")


def _free_address() -> str:
    """A port free now, for ranks this benchmark alone starts (nothing else starts groups beside it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"

def tp_section(bench: Bench) -> None:
    """Decode and prefill of the model split over T ranks, one process each (rank 0 reports)."""
    import multiprocessing as mp

    torch = bench.torch
    gpus = 0 if bench.smoke else torch.cuda.device_count()
    sizes = [2] if bench.smoke else [t for t in (2, 4) if gpus >= t]
    if not sizes:
        bench.result["tp"] = {"skipped": f"{gpus} GPU(s) here: tensor parallelism needs 2 or more"}
        return
    rows = bench.result["tp"] = []
    ctx = mp.get_context("spawn")
    for size in sizes:
        if bench.time_left() < 60:
            rows.append({"tp": size, "skipped": "budget"})
            continue
        q = ctx.Queue()
        address = _free_address()
        procs = [ctx.Process(target=_tp_rank, args=(r, size, address, bench.smoke, q)) for r in range(size)]
        for p in procs:
            p.start()
        try:
            got = q.get(timeout=max(60.0, bench.time_left()))
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        if isinstance(got, str):
            bench.result["errors"].append({"where": f"tp.{size}", "error": got})
            rows.append({"tp": size, "skipped": "error"})
            continue
        rows.append(got)
        print(f"tp={size}: " + ", ".join(f"decode b{r['batch']} {r['step_ms']:.2f} ms" for r in got["decode"])
              + f", prefill {got['prefill']['tokens']} tokens {got['prefill']['seconds'] * 1e3:.1f} ms", flush=True)


def _tp_rank(rank: int, size: int, address: str, smoke: bool, q) -> None:
    """One rank: its shard of the model (random weights), its KV heads' pool, the timed steps."""
    import torch

    from splitserve.engine.attention.backend import AttentionBatch, SeqSlice, get_backend
    from splitserve.engine.model.llama import LlamaModel
    from splitserve.engine.parallel.group import DistGroup, GroupSpec
    from splitserve.engine.parallel.shard import Shard, local_config

    try:
        device = torch.device("cpu") if smoke else torch.device(f"cuda:{rank}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dtype = torch.float32 if smoke else torch.bfloat16
        cfg = model_config(SMOKE if smoke else LLAMA3_8B)
        tp = DistGroup(GroupSpec(rank, size, address, "gloo" if smoke else "nccl", 300.0))
        shard = Shard.of(cfg, rank, size)
        local = local_config(cfg, shard)
        torch.manual_seed(rank)
        with torch.device(device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                model = LlamaModel(local, cfg.max_position_embeddings, tp, shard).eval()
            finally:
                torch.set_default_dtype(prev)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
        bs, context = 16, (16 if smoke else 2048)
        batches = (1, 2) if smoke else (16, 64)
        prompt = 32 if smoke else 2048
        per_seq = -(-(context + 1) // bs)
        blocks = max(batches) * per_seq + -(-prompt // bs)
        kv = torch.zeros((cfg.num_layers, 2, blocks, bs, local.num_kv_heads, cfg.head_dim), dtype=dtype, device=device)
        layers = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)]
        be = get_backend("torch" if smoke else "triton", dtype, device, block_size=bs, head_dim=cfg.head_dim)

        def timed(fn, iters: int) -> float:
            for _ in range(2):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - t) / iters

        def run(num_seqs: int, ctx_len: int, q_len: int, first_block: int):
            slices, slots = [], []
            for s in range(num_seqs):
                ids_ = tuple(range(first_block + s * per_seq, first_block + s * per_seq + -(-ctx_len // bs)))
                slices.append(SeqSlice(q_start=s * q_len, q_len=q_len, ctx_len=ctx_len, block_ids=ids_))
                slots += [ids_[p // bs] * bs + p % bs for p in range(ctx_len - q_len, ctx_len)]
            batch = AttentionBatch(num_tokens=num_seqs * q_len, slot_mapping=torch.tensor(slots, device=device),
                                   decodes=tuple(slices) if q_len == 1 else (),
                                   prefills=() if q_len == 1 else tuple(slices), block_size=bs)
            meta = be.prepare(batch)
            ids = torch.randint(0, cfg.vocab_size, (num_seqs * q_len,), device=device)
            pos = torch.tensor([p for _ in range(num_seqs) for p in range(ctx_len - q_len, ctx_len)], device=device)
            return lambda: model.compute_logits(model(ids, pos, layers, be, meta)[-num_seqs:])

        with torch.inference_mode():
            decode = [{"batch": b, "context": context, "step_ms": 1e3 * timed(run(b, context + 1, 1, 0), 3 if smoke else 10)}
                      for b in batches]
            prefill = {"tokens": prompt, "seconds": timed(run(1, prompt, prompt, max(batches) * per_seq), 2 if smoke else 5)}
        if rank == 0:
            q.put({"tp": size, "decode": decode, "prefill": prefill, "kv_heads_per_rank": local.num_kv_heads})
        tp.close()
    except Exception:  # the parent records it and goes on
        if rank == 0:
            q.put(traceback.format_exc(limit=6))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_bench.json or results/gpu_bench.json)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting new measurements after this")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, if the GPU name is not known")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    ap.add_argument("--sections",
                    default="kernels,quant_gemm,fp8_kv_decode,decode,verify,draft,prefill,fused_ablation,host_tier,streaming,tp")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu_bench.json" if os.environ.get("OUT")
                            else ROOT / "results" / "gpu_bench.json"))
    t0 = time.monotonic()
    bench = Bench(args)
    sections = args.sections.split(",")
    bench.env()
    bench.copy_bandwidth()
    if "kernels" in sections:
        bench.guarded("kernels", bench.kernels)
    if "quant_gemm" in sections:
        bench.guarded("quant_gemm", bench.quant_gemm)
    if "fp8_kv_decode" in sections:  # before the model: its caches are freed before the pool is sized
        bench.guarded("fp8_kv_decode", bench.fp8_kv_decode)
    if {"decode", "verify", "draft", "prefill", "fused_ablation", "host_tier", "streaming"} & set(sections):
        bench.guarded("model", bench.build_model)
        need = 512 if args.smoke else 256 * (8192 + 16)  # the largest batch x context (capped by memory)
        if hasattr(bench, "model"):
            bench.guarded("kv", lambda: bench.allocate_kv(need))
        for name in ("decode", "verify", "draft", "prefill", "fused_ablation", "host_tier", "streaming"):
            if name in sections and hasattr(bench, "kv_storage"):
                bench.guarded(name, getattr(bench, name))
    if "tp" in sections:
        bench.guarded("tp", lambda: tp_section(bench))
    bench.result["summary"] = bench.summary()
    bench.result["wall_s"] = round(time.monotonic() - t0, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(bench.result, indent=1, default=str))
    print("summary:", json.dumps(bench.result["summary"]), f"errors: {len(bench.result['errors'])}",
          f"wall {bench.result['wall_s']} s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
