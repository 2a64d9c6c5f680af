"""Which part of each weight one tensor-parallel rank holds (Megatron-style):

  column-parallel (output rows split): q/k/v (by attention head; a KV head is replicated on the
      T / num_kv_heads ranks whose query heads read it when there are fewer KV heads than
      ranks), gate/up, the vocab rows of the embedding and the LM head (padded to a multiple
      of T, the padding rows zero)
  row-parallel (input columns split, outputs all-reduced): o_proj, down_proj; a row-parallel
      bias is held by rank 0 alone, so that the sum adds it once
  experts: either each rank holds every expert's column/row shard (`expert_parallel` off), or
      each holds whole experts, num_experts / T of them (on); the router, norms and the shared
      expert's gate are replicated; the shared expert is split as a dense MLP is.
  latent attention (MLA, DeepSeek-V3): the per-head projections split by head — q_b_proj (or
      q_proj) and kv_b_proj column-parallel, o_proj row-parallel over v_head_dim columns — and
      the latent's (q_a_proj, kv_a_proj_with_mqa, their norms) replicated. Every rank computes
      and caches the whole latent, its one "KV head" (replicated as any KV head read by more
      ranks than there are KV heads): the latent cache is not divided by T, as in vLLM and
      SGLang's TP; splitting it would take attention data-parallel over requests instead.

Under data-parallel attention (engine/parallel/dp_engine.py) a rank is a whole engine of its own
(`Shard.data_parallel`): it holds every weight whole but the experts, of which it holds
num_experts / D, whole (`experts_only`).

A rank's model is the ordinary model built on `local_config` — the shard's head, KV head,
intermediate and expert counts — plus the all-reduces; the loader cuts each checkpoint tensor
with `narrow`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from splitserve.engine.model.config import MLAConfig, ModelConfig
from splitserve.types import ConfigError


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    heads: range  # query heads held (global indices)
    kv_heads: range  # KV heads held
    vocab: range  # vocab rows held (the padded range: may run past the vocab)
    experts: range  # whole experts held (all of them unless expert_parallel)
    expert_parallel: bool = False
    experts_only: bool = False  # data-parallel attention: every other weight whole, on every rank

    @staticmethod
    def of(cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False) -> "Shard":
        check(cfg, size, expert_parallel)
        h, kv = cfg.num_heads // size, cfg.num_kv_heads
        kv_heads = (range(rank * kv // size, (rank + 1) * kv // size) if kv >= size
                    else range(rank * kv // size, rank * kv // size + 1))
        v = -(-cfg.vocab_size // size)
        e = cfg.moe.num_experts if cfg.moe is not None else 0
        experts = range(rank * e // size, (rank + 1) * e // size) if expert_parallel else range(e)
        return Shard(rank, size, range(rank * h, (rank + 1) * h), kv_heads, range(rank * v, (rank + 1) * v),
                     experts, expert_parallel)

    @staticmethod
    def data_parallel(cfg: ModelConfig, rank: int, size: int) -> "Shard":
        """Replica `rank` of `size` data-parallel ones: its contiguous share of the experts, the
        rest whole."""
        e = cfg.moe.num_experts
        return Shard(rank, size, range(cfg.num_heads), range(cfg.num_kv_heads), range(cfg.vocab_size),
                     range(rank * e // size, (rank + 1) * e // size), expert_parallel=True, experts_only=True)

    def split(self, n: int) -> slice:
        """This rank's part of a dimension of `n` split evenly (intermediate columns)."""
        return slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)


def check(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Refuse, naming the reason, a tensor-parallel size the model's shapes do not divide by."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    need = {"num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size}
    if cfg.moe is not None:
        if expert_parallel:
            need["num_experts"] = cfg.moe.num_experts
        else:
            need["moe_intermediate_size"] = cfg.moe.expert_intermediate_size
        if cfg.moe.shared_expert_intermediate_size:
            need["shared_expert_intermediate_size"] = cfg.moe.shared_expert_intermediate_size
    for name, n in need.items():
        if n % size:
            raise ConfigError(f"tensor_parallel_size {size} does not divide {name} {n}")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(f"tensor_parallel_size {size} and num_key_value_heads {kv}: one must divide the other")


def local_config(cfg: ModelConfig, s: Shard) -> ModelConfig:
    """The shapes one rank's model is built with."""
    if s.experts_only:  # the experts held are Shard.experts; each of them whole
        return cfg
    moe = cfg.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe, expert_intermediate_size=moe.expert_intermediate_size // (1 if s.expert_parallel else s.size),
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size // s.size)
    return dataclasses.replace(cfg, num_heads=len(s.heads), num_kv_heads=len(s.kv_heads),
                               intermediate_size=cfg.intermediate_size // s.size, moe=moe)


def narrow(pname: str, t: torch.Tensor, cfg: ModelConfig, s: Shard, piece: int | None = None,
           expert: int | None = None) -> torch.Tensor | None:
    """This rank's part of checkpoint tensor `t`, bound for our parameter `pname` (its q/k/v or
    gate/up `piece`; a stacked experts tensor, or one `expert`'s); None: this rank holds none
    of it (an expert elsewhere)."""
    if s.size == 1:
        return t
    d = cfg.head_dim
    if ".experts." in pname:
        return _narrow_experts(pname, t, s, expert)
    if s.experts_only:
        return t
    if cfg.mla is not None and ".self_attn." in pname:
        return _narrow_latent_attention(pname, t, cfg.mla, s)
    if "qkv_proj" in pname:
        heads = s.heads if piece == 0 else s.kv_heads
        return t[heads.start * d: heads.stop * d]
    if "o_proj" in pname:
        return _row_parallel_o_proj(pname, t, s, d)
    if "gate_up_proj" in pname:  # one piece (gate or up) of a dense or shared-expert MLP
        return t[s.split(t.shape[0])]
    if "down_proj" in pname:
        return t[:, s.split(t.shape[1])]
    if pname in ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight"):  # the last: an MTP layer's
        return _vocab_rows(t, s)
    return t  # norms, the router, the shared expert's gate: every rank holds them whole


def _row_parallel_o_proj(pname: str, t: torch.Tensor, s: Shard, d: int) -> torch.Tensor:
    """o_proj's input columns of this rank's heads (`d` each); its bias on rank 0 alone."""
    if pname.endswith("bias"):
        return t if s.rank == 0 else torch.zeros_like(t)
    return t[:, s.heads.start * d: s.heads.stop * d]


def _narrow_latent_attention(pname: str, t: torch.Tensor, m: MLAConfig, s: Shard) -> torch.Tensor:
    """MLA: the rows of this rank's heads in the per-head projections, o_proj's columns of
    them; the latent's projections and norms whole."""
    proj = pname.split(".")[-2]
    per_head = {"q_proj": m.qk_head_dim, "q_b_proj": m.qk_head_dim, "kv_b_proj": m.qk_nope_head_dim + m.v_head_dim}
    if proj in per_head:
        d = per_head[proj]
        return t[s.heads.start * d: s.heads.stop * d]
    if proj == "o_proj":
        return _row_parallel_o_proj(pname, t, s, m.v_head_dim)
    return t  # q_a_proj, kv_a_proj_with_mqa, q_a_layernorm, kv_a_layernorm


def _narrow_experts(pname: str, t: torch.Tensor, s: Shard, expert: int | None) -> torch.Tensor | None:
    stacked = expert is None  # [E, ...] as transformers 5 writes it, else one expert's [out, in]
    if s.expert_parallel:
        if stacked:
            return t[s.experts.start: s.experts.stop]
        return t if expert in s.experts else None
    if "gate_up_proj" in pname:
        if stacked:  # [E, 2I, H]: this rank's columns of the gate half and of the up half
            gate, up = t.chunk(2, dim=1)
            return torch.cat((gate[:, s.split(gate.shape[1])], up[:, s.split(up.shape[1])]), dim=1)
        return t[s.split(t.shape[0])]
    return t[..., s.split(t.shape[-1])]  # down: [E, H, I] or [H, I]


def _vocab_rows(t: torch.Tensor, s: Shard) -> torch.Tensor:
    rows = t[s.vocab.start: min(s.vocab.stop, t.shape[0])]
    pad = len(s.vocab) - rows.shape[0]
    return torch.cat((rows, rows.new_zeros(pad, *rows.shape[1:]))) if pad > 0 else rows
