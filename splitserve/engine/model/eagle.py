"""An EAGLE(-1)-style draft head given as a directory (speculative `draft_path`;
engine/speculative/draft.py runs it), and its loader.

The directory holds a config.json of a one-layer Llama decoder and its weights
(`*.safetensors`, or `pytorch_model.bin` as EAGLE's releases ship them; names with or without a
`model.` prefix): `fc` [H, 2H] (a bias if it ships one), `layers.0.*`, and optionally its own
`embed_tokens` and `lm_head` — else it shares the target's. At position i it reads the target's
hidden state h_i (after the target's final norm) and the embedding of token i+1:

    x = fc(cat(embed(t_{i+1}), h_i));  x = layer(x);  logits = lm_head(x)

— the guess for token i+2, with no norm before the LM head (EAGLE's training); x is what the
next step of a chain reads in place of h. EAGLE-1 heads ship no `input_layernorm` for their
layer (the fc output enters attention unnormed); where one ships it, it is used.

Its KV is one more layer of the target's paged cache, so its attention must have the target
layers' geometry (KV heads, head dim) — refused by name otherwise.

Under tensor parallelism each rank holds its shard of the head as of a target layer (parallel/
shard.py: query and KV heads, MLP columns; an own embedding and LM head by vocab rows, gathered
as the target's are; fc and the norms whole), and every rank runs it in step (draft.py)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.layers import RotaryEmbedding
from splitserve.engine.model.llama import DecoderLayer, LlamaModel, vocab_embed, vocab_logits
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.shard import Shard, local_config
from splitserve.engine.parallel.shard import check as check_tp
from splitserve.types import ConfigError


class EagleHead(nn.Module):
    """`cfg`: the head's whole config; `shard`: this rank's part of it (None: all of it)."""

    def __init__(self, cfg: ModelConfig, target: LlamaModel, max_positions: int, *, own_embedding: bool,
                 own_lm_head: bool, fc_bias: bool, input_norm: bool, tp: TPGroup | None = None,
                 shard: Shard | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self._target = (target,)  # a tuple: not registered, so not this module's parameters
        self.tp, self.shard, self.vocab = tp or TPGroup(), shard, cfg.vocab_size
        rows = cfg.vocab_size if shard is None else len(shard.vocab)
        self.embed_tokens = nn.Embedding(rows, h, _weight=torch.empty(rows, h)) if own_embedding else None
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layer = DecoderLayer(cfg if shard is None else local_config(cfg, shard), 0, self.tp, shard)
        if not input_norm:
            self.layer.input_layernorm = nn.Identity()
        self.lm_head = nn.Linear(h, rows, bias=False) if own_lm_head else None
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rope_dim, max_positions)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            return self._target[0].embed(ids)
        return vocab_embed(self.embed_tokens, ids, self.shard, self.tp)

    def forward(self, ids, feature, cos, sin, kv, backend, meta) -> torch.Tensor:
        """The head's output at each row (token `ids`, the hidden state `feature` before it)."""
        x = self.fc(torch.cat((self.embed(ids), feature), dim=-1))
        return self.layer(x, cos, sin, kv, backend, meta)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self._target[0].lm_head
        return vocab_logits(head, out, self.shard, self.tp, self.vocab).float()


def load_eagle(head_dir: str | Path, target_cfg: ModelConfig, target: LlamaModel, max_positions: int,
               dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None,
               target_shard: Shard | None = None) -> EagleHead:
    """`target_shard`: the target's rank under tensor parallelism (None: one process); the head
    is cut for the same rank."""
    # the loader (safetensors) here, not at import: the GPU benchmark builds a head with neither
    from splitserve.engine.model.loader import fill_params, layer_param

    head_dir = Path(head_dir)
    cfg = eagle_config(head_dir, target_cfg, 1 if target_shard is None else target_shard.size)
    where = f"the EAGLE head in {head_dir}"
    # its own query heads and MLP columns on the target's rank (its KV heads and vocab are the
    # target's, so they split as the target's do)
    shard = None if target_shard is None else Shard.of(cfg, target_shard.rank, target_shard.size)
    with ExitStack() as files:
        tensors = _read(head_dir, files)
        names = set(tensors)
        if "fc.weight" not in names:
            raise ConfigError(f"{where} has no fc.weight (the [hidden, 2 * hidden] projection of an EAGLE head)")
        with torch.device("meta"):
            head = EagleHead(cfg, target, max_positions, own_embedding="embed_tokens.weight" in names,
                             own_lm_head="lm_head.weight" in names, fc_bias="fc.bias" in names,
                             input_norm="layers.0.input_layernorm.weight" in names, tp=tp, shard=shard)
        head = head.to_empty(device=device)
        head.rotary.__init__(cfg.rope, cfg.rope_dim, max_positions)  # buffers are computed, not loaded
        head.rotary.to(device)
        if "lm_head.weight" not in names and target.lm_head is None:
            raise ConfigError(f"{where} ships no lm_head and the target holds none here")
        items = []
        for name in sorted(names):
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name.startswith("layers.0."):
                pname, region = layer_param(name[len("layers.0."):], cfg)
                pname = f"layer.{pname}"
            else:
                pname, region = name, (None, None)
            items.append((pname, region, name, tensors[name]()))
        params = {n: p for n, p in head.named_parameters()}
        fill_params(params, items, cfg, where, shard)
    return head.to(dtype).eval()


def eagle_config(head_dir: str | Path, target_cfg: ModelConfig, tensor_parallel_size: int = 1) -> ModelConfig:
    """The head's config, checked against the target's — and under tensor parallelism, that
    its shapes split — from the files' names and configs alone (no weights read): what a driver
    refuses before any worker starts (control/launch.py)."""
    head_dir = Path(head_dir)
    where = f"the EAGLE head in {head_dir}"
    if not (head_dir / "config.json").is_file():
        raise ConfigError(f"speculative.draft_path {str(head_dir)!r} holds no EAGLE head: no config.json (an EAGLE "
                          "head's directory holds the config.json of a one-layer Llama decoder and its weights)")
    cfg = ModelConfig.from_dir(head_dir)
    _check_geometry(cfg, target_cfg, where)
    try:
        check_tp(cfg, tensor_parallel_size)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if not any(head_dir.glob("*.safetensors")) and not (head_dir / "pytorch_model.bin").is_file():
        raise ConfigError(f"{where} has no weights (*.safetensors or pytorch_model.bin)")
    return cfg


def _check_geometry(cfg: ModelConfig, target: ModelConfig, where: str) -> None:
    """The head's KV is a layer of the target's cache, and its fc reads the target's hidden states."""
    if cfg.num_layers != 1:
        raise ConfigError(f"{where} has {cfg.num_layers} decoder layers; an EAGLE head has one")
    if cfg.mla is not None or cfg.moe is not None:
        raise ConfigError(f"{where} is not a dense Llama layer ({cfg.architecture})")
    if target.mla is not None:
        raise ConfigError(f"{where}: the target ({target.architecture}) caches one latent per token, which an EAGLE "
                          "head's attention cannot share a cache layer with; run its MTP layer (no draft_path)")
    for name, ours, theirs in (("hidden_size", cfg.hidden_size, target.hidden_size),
                               ("num_key_value_heads", cfg.num_kv_heads, target.num_kv_heads),
                               ("head_dim", cfg.head_dim, target.head_dim),
                               ("vocab_size", cfg.vocab_size, target.vocab_size)):
        if ours != theirs:
            raise ConfigError(f"{where}: its {name} is {ours}, the target's {theirs}; its KV is one more layer of "
                              "the target's cache and it reads the target's hidden states, so they must be equal")


def _read(head_dir: Path, files: ExitStack) -> dict:
    """name (without a `model.` prefix) -> a thunk reading its tensor (`eagle_config` has made
    sure there are weights)."""
    from splitserve.engine.model.loader import open_tensors

    shards = sorted(head_dir.glob("*.safetensors"))
    if shards:
        return {n.removeprefix("model."): (lambda f=f, n=n: f.get_tensor(n))
                for n, f in open_tensors(files, shards).items()}
    state = torch.load(head_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return {n.removeprefix("model."): (lambda t=t: t) for n, t in state.items()}
