"""Which grammar library constrains our decoding (issue 29): the cost of one step's token masks
on the demo model's 49,152-token vocabulary, at batch 1 / 32 / 128, for xgrammar and llguidance.

Every row of a batch follows the same JSON-schema grammar through a real answer (its tokens from
the model's own tokenizer); a step is what the engine would do per step: fill every row's bitmask
(each library's batched, multi-threaded fill), apply it to a [batch, vocab] logits tensor, and
advance every row's matcher by its token. Compile time is measured separately (cold, per schema).
Also recorded: whether importing the library loads torch (an ingress replica must not, and it is
where bad schemas are refused).

    python benchmarks/grammar_masks.py            # -> results/grammar_masks/grammar_masks.{json,png}
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from splitserve.engine.model.config import ModelConfig  # noqa: E402
from splitserve.engine.model.demo import ensure_demo_model  # noqa: E402

OUT = ROOT / "results" / "grammar_masks"
BATCHES = (1, 32, 128)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
ANSWER = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", '
          '"poetry"], "address": {"city": "London", "zip": "W1"}, "active": true}')


def imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: list[int]) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        g = self.llg.LLMatcher.grammar_from_json_schema(schema)
        err = self.llg.LLMatcher.validate_grammar(g, self.tok)
        assert not err, err
        return g

    def matchers(self, grammar, n: int) -> list:
        return [self.llg.LLMatcher(self.tok, grammar) for _ in range(n)]

    def bitmask(self, n: int, vocab: int) -> torch.Tensor:
        from llguidance.torch import allocate_token_bitmask

        return allocate_token_bitmask(n, vocab)

    def fill(self, ms: list, mask: torch.Tensor) -> None:
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], mask)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        from splitserve.engine.grammar import unpack  # what the engine applies (no torch.compile)

        logits.masked_fill_(~unpack(mask, logits.shape[1]), float("-inf"))

    def accept(self, ms: list, tok: int) -> None:
        for m in ms:
            assert m.consume_token(tok), m.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, model_dir: str, eos: list[int], vocab: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, grammar, n: int) -> list:
        return [self.xgr.GrammarMatcher(grammar) for _ in range(n)]

    def bitmask(self, n: int, vocab: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, vocab)

    def fill(self, ms: list, mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, mask)

    def accept(self, ms: list, tok: int) -> None:
        ok = self.batch.batch_accept_token(ms, [tok] * len(ms))
        assert all(ok)


def step_times(lib, grammar, tokens: list[int], batch: int, vocab: int) -> list[float]:
    ms = lib.matchers(grammar, batch)
    mask = lib.bitmask(batch, vocab)
    logits = torch.zeros(batch, vocab)
    times = []
    for tok in tokens:
        logits.zero_()  # a fresh step's logits
        t0 = time.perf_counter()
        lib.fill(ms, mask)
        lib.apply(logits, mask)
        times.append(time.perf_counter() - t0)
        assert logits[0, tok] == 0, "the answer's token was masked out"
        lib.accept(ms, tok)
    return times


def main() -> None:
    model = ensure_demo_model()
    mc = ModelConfig.from_dir(model)
    eos = list(mc.eos_token_ids)
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(str(model / "tokenizer.json")).encode(ANSWER, add_special_tokens=False).ids
    tokens += [eos[0]]
    vocab = mc.vocab_size
    libs = [LLGuidance(str(model / "tokenizer.json"), eos), XGrammar(str(model), eos, vocab)]
    report = {"vocab": vocab, "answer_tokens": len(tokens), "torch_threads": torch.get_num_threads(), "libraries": {}}
    for lib in libs:
        t0 = time.perf_counter()
        grammar = lib.compile(SCHEMA)
        compile_s = time.perf_counter() - t0
        row = {"compile_ms": compile_s * 1e3, "imports_torch": imports_torch(lib.name), "step_us": {}}
        for b in BATCHES:
            step_times(lib, grammar, tokens[:8], b, vocab)  # warm up
            ts = step_times(lib, grammar, tokens, b, vocab)
            row["step_us"][b] = {"p50": statistics.median(ts) * 1e6, "mean": statistics.fmean(ts) * 1e6,
                                 "p99": sorted(ts)[int(0.99 * (len(ts) - 1))] * 1e6}
            print(f"{lib.name:10s} batch {b:4d}: mask+apply p50 {row['step_us'][b]['p50']:9.1f} us  "
                  f"mean {row['step_us'][b]['mean']:9.1f} us", flush=True)
        print(f"{lib.name:10s} compile {row['compile_ms']:.1f} ms; imports torch: {row['imports_torch']}")
        report["libraries"][lib.name] = row
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "grammar_masks.json").write_text(json.dumps(report, indent=2))
    _plot(report)


def _plot(report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in report["libraries"].items():
        ax.plot(list(BATCHES), [row["step_us"][b]["mean"] / 1e3 for b in BATCHES], marker="o", label=name)
    ax.set_xlabel("rows with a grammar in the batch")
    ax.set_ylabel("mask fill + apply per step (ms, mean)")
    ax.set_title(f"Token masks, JSON schema, vocab {report['vocab']}")
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "grammar_masks.png", dpi=120)


if __name__ == "__main__":
    main()
