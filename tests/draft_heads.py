"""Draft heads for tests, built from transformers' own modules (an independent reference for
engine/model/mtp.py and eagle.py): an EAGLE head directory for a tiny Llama, a DeepSeek-V3
checkpoint with its multi-token-prediction layer, and `train` — a few hundred Adam steps that
distil the target's own next-next token into the head, so that its proposals are accepted
often enough to test both outcomes (a random head's almost never are)."""

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


def target_data(hf, n: int = 48, prompt_len: int = 12, new: int = 36, seed: int = 0):
    """Sequences the target continues greedily from random prompts, its hidden states (after
    the final norm) and its argmax at every position."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, hf.config.vocab_size, (n, prompt_len), generator=g)
    with torch.no_grad():
        seqs = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=0)
        out = hf.model(seqs)
        hidden = out.last_hidden_state
        argmax = hf.lm_head(hidden).argmax(-1)
    return seqs, hidden, argmax


def draft_inputs(seqs, hidden, argmax):
    """Draft position i: (h_i, t_{i+1}) -> the target's argmax at i + 1."""
    return seqs[:, 1:], hidden[:, :-1], argmax[:, 1:]


def train(head: nn.Module, hf, steps: int = 300, lr: float = 3e-3) -> float:
    """Distil the target's next-next token into `head`; its final training accuracy."""
    torch.manual_seed(0)
    ids, hidden, labels = draft_inputs(*target_data(hf))
    params = [p for n, p in head.named_parameters() if not n.startswith("shared_head.head")]
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        logits = head.logits(head(ids, hidden))
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float((head.logits(head(ids, hidden)).argmax(-1) == labels).float().mean())
