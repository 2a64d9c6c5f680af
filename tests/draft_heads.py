"""Draft heads for tests, built from transformers' own modules (an independent reference for
engine/model/mtp.py and eagle.py): an EAGLE head directory for a tiny Llama, a DeepSeek-V3
checkpoint with its multi-token-prediction layer. A random head's proposals are almost never
accepted, and a tiny random target is too chaotic for a head trained for seconds to predict
(tried: it memorises its training set, ~1% on new text); so `predictable` quiets a target's
layers (mostly a bigram model then) and `agree` builds a head that proposes that bigram's
answer — accepted often, rejected where the layers tip the target elsewhere."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


def _causal(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


class RefEagle(nn.Module):
    """EAGLE-1: fc over cat(embed(t_{i+1}), h_i), one Llama layer without input norm, the
    target's LM head with no norm before it."""

    def __init__(self, hf) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        cfg = hf.config
        self.target = (hf,)
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = LlamaDecoderLayer(cfg, 0)
        self.layer.input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_ids [B, T], hidden [B, T, H] (the target's, after its final norm) -> [B, T, H]."""
        x = self.fc(torch.cat((self.target[0].model.embed_tokens(next_ids), hidden), dim=-1))
        pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        return self.layer(x, attention_mask=_causal(x.shape[1]), position_ids=pos,
                          position_embeddings=self.rotary(x, pos))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.target[0].lm_head(out)

    def save(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.target[0].config.to_dict()
        cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
        (out_dir / "config.json").write_text(json.dumps(cfg))
        sd = {("layers.0." + k[len("layer."):] if k.startswith("layer.") else k): v.detach().contiguous()
              for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        save_file(sd, str(out_dir / "model.safetensors"))
        return out_dir


class RefMTP(nn.Module):
    """DeepSeek-V3's MTP module: eh_proj over cat(enorm(embed(t_{i+1})), hnorm(h_i)), a full
    DeepSeek-V3 decoder layer (index num_hidden_layers), shared_head.norm + head."""

    def __init__(self, hf) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer, DeepseekV3RMSNorm,
                                                                          DeepseekV3RotaryEmbedding)

        super().__init__()
        cfg = hf.config
        self.index = cfg.num_hidden_layers
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.enorm, self.hnorm = DeepseekV3RMSNorm(h, eps), DeepseekV3RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekV3DecoderLayer(cfg, self.index)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(h, eps)
        self.shared_head.head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.rotary = DeepseekV3RotaryEmbedding(cfg)
        with torch.no_grad():  # start from the target's own embedding and head, as DeepSeek ships them
            self.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
            self.shared_head.head.weight.copy_(hf.lm_head.weight)
            self.layer.mlp.gate.e_score_correction_bias.normal_(0, 0.2)
            for p in self.layer.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.1)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(next_ids)), self.hnorm(hidden)), dim=-1))
        pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        return self.layer(x, attention_mask=_causal(x.shape[1]), position_ids=pos,
                          position_embeddings=self.rotary(x, pos))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(out))

    def save_into(self, checkpoint: Path, out_dir: Path) -> Path:
        """A copy of `checkpoint` that also holds this module as its layer num_hidden_layers."""
        shutil.copytree(checkpoint, out_dir)
        prefix = f"model.layers.{self.index}."
        sd = {prefix + (k[len("layer."):] if k.startswith("layer.") else k): v.detach().contiguous()
              for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        save_file(sd, str(out_dir / "mtp.safetensors"))
        cfg = json.loads((out_dir / "config.json").read_text())
        cfg["num_nextn_predict_layers"] = 1
        (out_dir / "config.json").write_text(json.dumps(cfg))
        return out_dir


def predictable(checkpoint: Path, out_dir: Path, scale: float = 0.1) -> Path:
    """A copy of `checkpoint` whose layers write 10x less into the residual stream (o_proj and
    the feed-forward's down projections scaled): its next token depends mostly on the current
    one, which a one-layer head can learn in seconds — a random tiny model's is chaotic, and no
    head trained briefly predicts it. Its logits stay as decisive as the original's."""
    from safetensors import safe_open

    shutil.copytree(checkpoint, out_dir)
    for f in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as src:
            sd = {k: src.get_tensor(k) for k in src.keys()}
            meta = src.metadata()
        for k, v in sd.items():
            if k.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                sd[k] = (v * scale).contiguous()
        save_file(sd, str(f), metadata=meta)
    return out_dir


def agree(head: nn.Module, hf) -> nn.Module:
    """Make `head` propose what a bigram target says: its argmax at i+1 from token i+1 alone.
    On a `predictable` target that is right most of the time (not always: the layers still add
    a little), so proposals are both accepted and rejected. The head's own layer keeps small
    random weights (its attention and feed-forward still run and move the result a little)."""
    norm_w = hf.model.norm.weight.detach()
    h = norm_w.shape[0]
    with torch.no_grad():
        for name, p in head.layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                p.normal_(0, 1e-3)
        if isinstance(head, RefEagle):  # logits = lm_head(out), no norm: fold the target's into fc
            head.fc.weight.zero_()
            head.fc.weight[:, :h] = torch.diag(norm_w)
            if head.fc.bias is not None:
                head.fc.bias.zero_()
        else:  # eh_proj passes enorm(embed) on; shared_head.norm is the target's final norm
            head.eh_proj.weight.zero_()
            head.eh_proj.weight[:, :h] = torch.eye(h)
            head.enorm.weight.fill_(1.0)
            head.shared_head.norm.weight.copy_(norm_w)
    return head
