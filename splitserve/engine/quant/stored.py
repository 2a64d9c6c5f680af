"""One projection's weight as the checkpoint stores it, kept that way (quant/linear.py): checked
once, cut to a tensor-parallel rank's part, fused with the projections the model computes in one
matmul (q/k/v, gate/up), or dequantized where it cannot stay.

Layouts (W the dense weight, [out N, in K]):
  FP8   `weight` [N, K] e4m3 / e5m2; `scale` fp32: [1] (per tensor), [N, 1] (per output row) or
        [ceil(N / bn), ceil(K / bk)] (per bn x bk block, the last ones possibly partial)
  AWQ   `qweight` int32 [K, N / 8] (eight output columns a word), `qzeros` [G, N / 8], `scales` [G, N]
  GPTQ  `qweight` int32 [K / 8, N] (eight input rows a word), `qzeros` [G, N / 8], `scales` [G, N],
        `g_idx` [K] (each input row's group; act-order checkpoints permute it) or absent

A cut or a fusion keeps every scale with the values it scales. Where that is impossible — a cut
through an FP8 scale block or a packed word, an input cut of act-order GPTQ whose rows use more
groups than a GEMM of that width takes, fused parts whose block scales or g_idx cannot be shared —
`cut` / `fuse` answer why (a str) and the caller dequantizes that projection instead."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.quant import fp8, int4
from splitserve.engine.quant.config import QuantMethod, WeightQuant

Cut = tuple[slice, slice]  # (output rows, input columns) of W


@dataclass(frozen=True, eq=False)
class StoredWeight:
    method: QuantMethod
    out_features: int
    in_features: int
    tensors: dict[str, torch.Tensor]  # by role (module docstring), contiguous
    block: tuple[int, int] | None = None  # FP8 block scales' (bn, bk); None: per tensor / per row

    @staticmethod
    def of(raw: dict[str, torch.Tensor], quant: WeightQuant) -> "StoredWeight":
        """From checkpoint.stored_tensors' answer; ValueError naming what does not fit."""
        if quant.method in (QuantMethod.AWQ, QuantMethod.GPTQ):
            return _int_weight(raw, quant)
        weight, scale = raw["weight"], raw["scale"].to(torch.float32)
        n, k = weight.shape
        block = None
        if quant.block is not None and scale.numel() > 1:
            block = tuple(quant.block)
            _need(tuple(scale.shape) == _blocks(n, k, block), f"block scales {tuple(scale.shape)}", (n, k), block)
        elif scale.numel() == 1:
            scale = scale.reshape(1)
        else:
            _need(scale.numel() == n, f"weight scale {tuple(scale.shape)}", (n, k), "one per tensor or row")
            scale = scale.reshape(n, 1)
        return StoredWeight(quant.method, n, k, {"weight": weight.contiguous(), "scale": scale.contiguous()}, block)

    def dequantize(self, quant: WeightQuant) -> torch.Tensor:
        """The dense weight [N, K] in fp32, as checkpoint.dense_tensors computes it."""
        t = self.tensors
        if self.method is QuantMethod.AWQ:
            return int4.dequantize_awq(t["qweight"], t["qzeros"], t["scales"], quant.group_size)
        if self.method is QuantMethod.GPTQ:
            return int4.dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), quant.bits,
                                        quant.group_size, quant.zeros_minus_one)
        return fp8.dequantize(t["weight"], t["scale"], self.block)

    def _with(self, n: int, k: int, **tensors: torch.Tensor) -> "StoredWeight":
        t = dict(self.tensors, **{name: v.contiguous() for name, v in tensors.items()})
        return StoredWeight(self.method, n, k, t, self.block)


def _blocks(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-n // block[0]), -(-k // block[1])


def _need(ok: bool, what: str, shape: tuple[int, int], how) -> None:
    if not ok:
        raise ValueError(f"{what} do not fit a {shape[0]}x{shape[1]} weight ({how})")


def _int_weight(raw: dict[str, torch.Tensor], quant: WeightQuant) -> StoredWeight:
    q = raw["qweight"]
    per = 32 // quant.bits
    awq = quant.method is QuantMethod.AWQ
    k, n = (q.shape[0], q.shape[1] * per) if awq else (q.shape[0] * per, q.shape[1])
    t = {name: raw[name].contiguous() for name in ("qweight", "qzeros", "scales", "g_idx") if name in raw}
    groups = t["scales"].shape[0]
    _need(q.dtype == torch.int32 and t["qzeros"].dtype == torch.int32, "qweight / qzeros not int32", (n, k), "packed")
    _need(tuple(t["qzeros"].shape) == (groups, n // per) and tuple(t["scales"].shape) == (groups, n),
          f"qzeros {tuple(t['qzeros'].shape)} / scales {tuple(t['scales'].shape)}", (n, k), f"{groups} groups")
    if "g_idx" in t:
        g = t["g_idx"] = t["g_idx"].to(torch.int32)
        _need(tuple(g.shape) == (k,) and (k == 0 or 0 <= int(g.min()) <= int(g.max()) < groups),
              f"g_idx {tuple(g.shape)}", (n, k), f"each input row's group among {groups}")
    else:
        want = 1 if quant.group_size == -1 else -(-k // quant.group_size)
        _need(groups == want, f"{groups} scale groups", (n, k), f"groups of {quant.group_size} input rows")
    return StoredWeight(quant.method, n, k, t)


def cut(w: StoredWeight, rows: slice, cols: slice, quant: WeightQuant) -> StoredWeight | str:
    """The part of `w` whose dense weight is W[rows, cols] (one rank's), or why it cannot be cut."""
    if (rows.start, rows.stop, cols.start, cols.stop) == (0, w.out_features, 0, w.in_features):
        return w
    if w.method is QuantMethod.AWQ:
        return _cut_awq(w, rows, cols, quant)
    if w.method is QuantMethod.GPTQ:
        return _cut_gptq(w, rows, cols, quant)
    return _cut_fp8(w, rows, cols)


def _aligned(s: slice, size: int, whole: int) -> bool:
    return s.start % size == 0 and (s.stop % size == 0 or s.stop == whole)


def _span(s: slice, size: int) -> slice:
    """The blocks / groups of `size` that cover `s`."""
    return slice(s.start // size, -(-s.stop // size))


def _cut_fp8(w: StoredWeight, rows: slice, cols: slice) -> StoredWeight | str:
    scale = w.tensors["scale"]
    if w.block is not None:
        bn, bk = w.block
        if not (_aligned(rows, bn, w.out_features) and _aligned(cols, bk, w.in_features)):
            return (f"this rank's rows {rows.start}:{rows.stop} and columns {cols.start}:{cols.stop} "
                    f"split the {bn}x{bk} scale blocks")
        scale = scale[_span(rows, bn), _span(cols, bk)]
    elif scale.shape[0] > 1:  # per output row
        scale = scale[rows]
    return w._with(rows.stop - rows.start, cols.stop - cols.start, weight=w.tensors["weight"][rows, cols], scale=scale)


def _group_rows(w: StoredWeight, cols: slice, quant: WeightQuant) -> slice | str:
    """The scale / zero rows input columns `cols` read (no act order)."""
    if quant.group_size == -1:
        return slice(0, 1)
    if not _aligned(cols, quant.group_size, w.in_features):
        return f"this rank's input columns {cols.start}:{cols.stop} split groups of {quant.group_size}"
    return _span(cols, quant.group_size)


def _cut_awq(w: StoredWeight, rows: slice, cols: slice, quant: WeightQuant) -> StoredWeight | str:
    t = w.tensors
    if rows.start % 8 or rows.stop % 8:
        return f"this rank's output rows {rows.start}:{rows.stop} split AWQ's 8-column words"
    groups = _group_rows(w, cols, quant)
    if isinstance(groups, str):
        return groups
    words = slice(rows.start // 8, rows.stop // 8)
    return w._with(rows.stop - rows.start, cols.stop - cols.start, qweight=t["qweight"][cols, words],
                   qzeros=t["qzeros"][groups, words], scales=t["scales"][groups, rows])


def _cut_gptq(w: StoredWeight, rows: slice, cols: slice, quant: WeightQuant) -> StoredWeight | str:
    t = w.tensors
    if rows.start % 8 or rows.stop % 8 or cols.start % 8 or cols.stop % 8:
        return (f"this rank's rows {rows.start}:{rows.stop} / input columns {cols.start}:{cols.stop} "
                "split GPTQ's 8-value words")
    k = cols.stop - cols.start
    g_idx = t.get("g_idx")
    extra = {}
    if g_idx is None:
        groups = _group_rows(w, cols, quant)
        if isinstance(groups, str):
            return groups
    else:  # act order: keep the groups these rows use, renumbered; the GEMM takes ceil(k / g) of them
        local = g_idx[cols].long()
        used = torch.unique(local)
        want = 1 if quant.group_size == -1 else -(-k // quant.group_size)
        if len(used) > want:
            return (f"this rank's {k} input rows use {len(used)} act-order groups; "
                    f"a {k}-row GEMM takes {want}")
        groups = torch.cat((used, used[-1:].expand(want - len(used))))  # padding rows no g_idx names
        extra["g_idx"] = torch.searchsorted(used, local).to(torch.int32)
    return w._with(rows.stop - rows.start, k, qweight=t["qweight"][cols.start // 8: cols.stop // 8, rows],
                   qzeros=t["qzeros"][groups][:, rows.start // 8: rows.stop // 8],
                   scales=t["scales"][groups][:, rows], **extra)


def fuse(parts: list[StoredWeight]) -> StoredWeight | str:
    """The parts stacked along the output (q, k, v or gate, up: one weight, one GEMM), or why not."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any(p.in_features != first.in_features for p in parts):
        return "the parts' input widths differ"
    n = sum(p.out_features for p in parts)
    if first.method is QuantMethod.AWQ or first.method is QuantMethod.GPTQ:
        g = [p.tensors.get("g_idx") for p in parts]
        if any((x is None) != (g[0] is None) or (x is not None and not torch.equal(x, g[0])) for x in g):
            return "the parts' act-order g_idx differ"
        cat = {name: torch.cat([p.tensors[name] for p in parts], dim=1) for name in ("qweight", "qzeros", "scales")}
        return first._with(n, first.in_features, **cat)
    if first.block is not None:
        bn = first.block[0]
        if any(p.out_features % bn for p in parts[:-1]):
            rows = [p.out_features for p in parts]
            return f"the parts' rows {rows} are not multiples of the {bn}-row scale blocks"
        scale = torch.cat([p.tensors["scale"] for p in parts])
    else:  # per tensor or per row: one scale per row of the fused weight
        scale = torch.cat([p.tensors["scale"].expand(p.out_features, 1) for p in parts])
    return first._with(n, first.in_features, weight=torch.cat([p.tensors["weight"] for p in parts]), scale=scale)
