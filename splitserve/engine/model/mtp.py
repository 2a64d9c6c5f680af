"""DeepSeek-V3's multi-token-prediction (MTP) module, run as a draft head (speculative method
`draft` with no draft_path; engine/speculative/draft.py runs it).

The checkpoint holds it as layer L = num_hidden_layers (`num_nextn_predict_layers` of them; the
first is run): `model.layers.{L}.` enorm, hnorm (RMSNorm), eh_proj [H, 2H], embed_tokens,
shared_head.norm + shared_head.head (an LM head), and a full decoder layer (latent attention,
DeepSeek's MoE) under the usual names. At position i it reads the target's hidden state h_i
(after the target's final norm) and the embedding of token i+1:

    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)));  x = layer(x);  logits = head(norm(x))

— the guess for token i+2; x itself is what the next step of a chain reads in place of h (as
vLLM and SGLang chain the module). Built from our own layer classes, so its KV has the target
layers' geometry (one latent per token) and lives as one more layer of the same paged cache.
Under tensor parallelism each rank holds the rank's shard of it a target layer has (heads,
expert columns or whole experts; its embedding and LM head by vocab rows, gathered as the
target's are; eh_proj and the norms whole)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.layers import RMSNorm
from splitserve.engine.model.llama import DecoderLayer, LlamaModel, vocab_embed, vocab_logits
from splitserve.engine.model.loader import fill_params, layer_param, open_tensors, safetensors_files
from splitserve.engine.model.moe import SparseMoE
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.shard import Shard, local_config
from splitserve.engine.quant.checkpoint import dense_tensors
from splitserve.types import ConfigError

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
        "embed_tokens.weight")


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, rows: int) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, rows, bias=False)


class MTPHead(nn.Module):
    """`target`: the model it drafts for; its embedding is used where the checkpoint ships the
    module without one (DeepSeek ships a copy), its rotary tables always. `cfg`: the model's
    whole config; `shard`: this rank's part (the target's; None: all of it)."""

    rotary = None  # the target's positions: the proposer uses the target's tables

    def __init__(self, cfg: ModelConfig, index: int, target: LlamaModel, own_embedding: bool,
                 tp: TPGroup | None = None, shard: Shard | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self._target = (target,)  # a tuple: not registered, so not this module's parameters
        self.tp, self.shard, self.vocab = tp or TPGroup(), shard, cfg.vocab_size
        rows = cfg.vocab_size if shard is None else len(shard.vocab)
        self.embed_tokens = nn.Embedding(rows, h, _weight=torch.empty(rows, h)) if own_embedding else None
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(cfg if shard is None else local_config(cfg, shard), index, self.tp, shard)
        self.shared_head = SharedHead(cfg, rows)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            return self._target[0].embed(ids)
        return vocab_embed(self.embed_tokens, ids, self.shard, self.tp)

    def forward(self, ids, feature, cos, sin, kv, backend, meta) -> torch.Tensor:
        """The module's output at each row (token `ids`, the hidden state `feature` before it)."""
        x = self.eh_proj(torch.cat((self.enorm(self.embed(ids)), self.hnorm(feature)), dim=-1))
        return self.layer(x, cos, sin, kv, backend, meta)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return vocab_logits(self.shared_head.head, self.shared_head.norm(out), self.shard, self.tp, self.vocab).float()


def check_mtp(model_dir: str | Path, cfg: ModelConfig) -> None:
    """From the config alone: what a driver refuses before any worker starts (control/launch.py)."""
    if cfg.extra_layers < 1:
        raise ConfigError(f"speculative method draft with no draft_path runs the checkpoint's multi-token-prediction "
                          f"layer, and {model_dir} has none (num_nextn_predict_layers is 0): give draft_path an "
                          "EAGLE head's directory")


def load_mtp(model_dir: str | Path, cfg: ModelConfig, target: LlamaModel, dtype: torch.dtype,
             device: torch.device, tp: TPGroup | None = None, shard: Shard | None = None) -> MTPHead:
    """The checkpoint's first MTP module (dequantized where stored quantized); under tensor
    parallelism `shard`'s part of it (the target's rank)."""
    check_mtp(model_dir, cfg)
    index = cfg.num_layers
    prefix = f"model.layers.{index}."
    where = f"{model_dir}: the multi-token-prediction layer {index}"
    with ExitStack() as files:
        found = {n: f for n, f in open_tensors(files, safetensors_files(Path(model_dir))).items()
                 if n.startswith(prefix)}
        if not found:
            raise ConfigError(f"{where}: config.json says num_nextn_predict_layers {cfg.extra_layers}, but the "
                              f"checkpoint holds no {prefix}* tensors")
        with torch.device("meta"):
            head = MTPHead(cfg, index, target, f"{prefix}embed_tokens.weight" in found, tp, shard)
        head = head.to_empty(device=device)
        for m in head.modules():  # counters are state, not weights
            if isinstance(m, SparseMoE):
                m.expert_tokens.zero_()
        items = []
        for name, tensor in dense_tensors(found, lambda n: found[n].get_tensor(n), cfg.quant):
            rest = name[len(prefix):]
            if rest.endswith("rotary_emb.inv_freq"):
                continue
            pname, region = (rest, (None, None)) if rest in _OWN else layer_param(rest, cfg)
            items.append((pname if rest in _OWN else f"layer.{pname}", region, name, tensor))
        fill_params(dict(head.named_parameters()), items, cfg, where, shard)
    head = head.to(dtype).eval()
    _share_copies(head, target)
    return head


def _share_copies(head: MTPHead, target: LlamaModel) -> None:
    """DeepSeek ships the target's embedding and LM head again inside the MTP layer: where the
    copy is equal, the head uses the target's (2 x vocab x hidden fewer weights held). Under
    tensor parallelism each rank compares its own vocab rows: a rank may share where another
    does not, and either way its rows hold the same values."""
    if head.embed_tokens is not None and torch.equal(head.embed_tokens.weight, target.embed_tokens.weight):
        head.embed_tokens = None
    if target.lm_head is not None and torch.equal(head.shared_head.head.weight, target.lm_head.weight):
        head.shared_head.head = target.lm_head
