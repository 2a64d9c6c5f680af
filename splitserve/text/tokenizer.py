"""Tokenizer and chat template of a local Hugging Face checkpoint, without transformers.

`tokenizer.json` is run by the `tokenizers` library; `tokenizer_config.json` supplies the chat
template (Jinja, rendered the way transformers renders it), the BOS/EOS strings and whether a
BOS is prepended. The router, the offline API and the benchmarks all tokenize through this one
class, so a prompt means the same token ids everywhere.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

from splitserve.types import ConfigError


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir} has no tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template") or _template_file(model_dir)
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        # Prepending BOS is the post-processor's job in tokenizer.json; `add_bos_token` in the
        # config (Llama 2 style) asks for it where the post-processor does not.
        self._add_bos = bool(self.config.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and self.bos_token is not None:
            bos = self._tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if not self.chat_template:
            raise ConfigError("this model has no chat template; use generate() with a plain prompt")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ConfigError(f"each message must be a dict with a 'role', got {m!r}")
        return _compile(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        # The template writes BOS itself where the model wants one, as in transformers.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def _template_file(model_dir: Path) -> str | None:
    p = model_dir / "chat_template.jinja"
    return p.read_text() if p.is_file() else None


def _raise(msg: str) -> None:
    raise ConfigError(f"chat template error: {msg}")


_CACHE: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    if source not in _CACHE:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _CACHE[source] = env.from_string(source)
    return _CACHE[source]
