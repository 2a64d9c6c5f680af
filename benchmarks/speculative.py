"""Speculative decoding (issue 36: n-gram and suffix proposals, adaptive k, a grammar's forced
tokens) on the demo model, one process, one engine without speculation and one per proposer
(`ngram`, `suffix`), greedy:

  (a) code edit: the prompt is a file, the task to return it with one change (the answer repeats
      the prompt: prompt lookup's best case);
  (b) tool-call JSON: a chat offering one tool whose call the request forces, as serving runs
      `tool_choice: required` — the tool offered in a system message (text/tool_calls.py
      `chat_inputs`: the demo model's template does not render tools), the answer constrained by
      the grammar serving builds for it (`format_for(template).grammar(tools, parallel)`, as
      ingress/http.py does), so the proposals include the tokens that grammar forces
      (engine/speculative/forced.py). Unconstrained, the demo model does not write a call at all
      here (it answers in prose, which is what an earlier version of this benchmark measured);
  (c) open chat: free text, little to look up (adaptive k must back off).

Each round's requests are one tenant of their own (`cache_salt`), so the suffix proposer learns
from the earlier requests of the same round (other cities' calls, the other files' edits), never
from the previous round's identical answers.

Per workload, each prompt alone (batch 1: TPOT is what speculation buys) and then all of them
together (a batch: the verify rows of every sequence attend in one batched call, torch_backend.py;
benchmarks/verify_step.py measures that step alone). Reports TPOT (median over requests), output tok/s, the
acceptance rate (accepted / proposed) and tokens per engine step (`tokens_per_step`). The runs alternate plain /
speculative, `--rounds` times, so the machine's drift and other load hit both alike; the JSON
records the load average (on a shared machine wall-clock TPOT is noisy: read the ratios, and
the acceptance and tokens per step, which do not depend on timing). Greedy outputs are checked
equal.

    python benchmarks/speculative.py [--max-tokens 128]   # -> results/speculative.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from splitserve import LLM, SamplingParams  # noqa: E402
from splitserve.text.tool_calls import Tool, chat_inputs, format_for  # noqa: E402
from splitserve.types import Request  # noqa: E402

OUT = ROOT / "results"
SPEC = {"method": "ngram", "k": 4, "min_n": 2, "max_n": 5, "adaptive": True}
SUFFIX = dict(SPEC, method="suffix")
WEATHER = Tool("get_weather", "The current weather in a city", json.dumps({
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}, sort_keys=True))

CODE = '''def parse_line(line: str) -> dict:
    """Split one CSV line of a sensor log into its fields."""
    parts = line.strip().split(",")
    if len(parts) != 4:
        raise ValueError(f"expected 4 fields, got {len(parts)}")
    station, when, value, unit = parts
    return {"station": station, "when": when, "value": float(value), "unit": unit}


def read_log(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            rows.append(parse_line(line))
    return rows


def mean_value(rows: list[dict]) -> float:
    if not rows:
        return 0.0
    return sum(r["value"] for r in rows) / len(rows)
'''

WORKLOADS = {
    "code_edit": [
        f"Here is a Python file:\n```python\n{CODE}```\nReturn the whole file, unchanged except that the "
        f"function `{old}` is renamed to `{new}` everywhere. Output only the code."
        for old, new in (("parse_line", "parse_row"), ("read_log", "load_log"), ("mean_value", "average"))
    ],
    "tool_json": [  # with TOOLS offered and a call forced (tool_choice: required)
        f"Get the weather in celsius for {cities}."
        for cities in ("Paris, London, Tokyo, Berlin and Madrid", "Rome, Oslo, Lima, Cairo and Seoul",
                       "Austin, Denver, Boston, Miami and Seattle")
    ],
    "open_chat": [
        "Tell me about the history of the bicycle.",
        "What should I consider when adopting a dog?",
        "Describe a quiet morning in a small fishing village.",
    ],
}
TOOLS = {"tool_json": (WEATHER,)}  # workloads whose requests offer tools and force a call


def chat_ids(llm: LLM, text: str, tools=None) -> list[int]:
    msgs, extra = chat_inputs([{"role": "user", "content": text}], tools, llm.tokenizer.chat_template)
    s = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **extra)
    return llm.tokenizer.encode(s, add_special_tokens=False)


def grammar_of(llm: LLM, tools):
    """The grammar serving gives a request forcing a call of `tools` (parallel calls allowed)."""
    return None if tools is None else format_for(llm.tokenizer.chat_template).grammar(tools, True)


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, tag: str, grammar=None, tenant=None) -> dict:
    """All `prompts` at once through the engine; per request its first-token and end times."""
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, grammar=grammar)
    before = eng.stats()
    first, end, tokens = {}, {}, {}
    decode_from = None  # (wall, cpu, tokens so far) once every request has its first token
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"{tag}-{i}", p, sp, cache_salt=tenant))
        tokens[f"{tag}-{i}"] = []
    while eng.has_unfinished():
        for c in eng.step():
            now = time.perf_counter()
            first.setdefault(c.request_id, now)
            tokens[c.request_id] += c.token_ids
            if c.finished:
                end[c.request_id] = now
        if decode_from is None and len(first) == len(prompts):
            decode_from = (time.perf_counter(), time.process_time(), sum(map(len, tokens.values())))
    wall = time.perf_counter() - t0
    after = eng.stats()
    n_decoded = sum(map(len, tokens.values())) - decode_from[2]
    tpot = [(end[r] - first[r]) / (len(t) - 1) for r, t in tokens.items() if len(t) > 1]
    proposed = after.spec_proposed_tokens_total - before.spec_proposed_tokens_total
    accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
    verify_s = after.spec_verify_step_seconds_total - before.spec_verify_step_seconds_total
    plain_s = after.spec_verify_step_plain_seconds_total - before.spec_verify_step_plain_seconds_total
    return {"tpot_s": tpot, "verify_step_s": verify_s, "verify_step_plain_s": plain_s, "out_tokens": sum(map(len, tokens.values())), "wall_s": wall,
            "decode_tokens": n_decoded, "decode_wall_s": time.perf_counter() - decode_from[0],
            "decode_cpu_s": time.process_time() - decode_from[1],
            "steps": after.steps_total - before.steps_total, "proposed": proposed, "accepted": accepted,
            "outputs": [tokens[f"{tag}-{i}"] for i in range(len(prompts))]}


def summarize(runs: list[dict]) -> dict:
    tpot = [t for r in runs for t in r["tpot_s"]]
    out = sum(r["out_tokens"] for r in runs)
    proposed, accepted = sum(r["proposed"] for r in runs), sum(r["accepted"] for r in runs)
    dec = sum(r["decode_tokens"] for r in runs)
    return {"tpot_ms_median": 1e3 * statistics.median(tpot), "output_tok_s": out / sum(r["wall_s"] for r in runs),
            # the decode phase (every request past its first token): wall and this process's CPU time
            # per output token — CPU time is far less disturbed by other load on a shared machine
            "decode_ms_per_token": 1e3 * sum(r["decode_wall_s"] for r in runs) / dec,
            "decode_cpu_ms_per_token": 1e3 * sum(r["decode_cpu_s"] for r in runs) / dec,
            "out_tokens": out, "steps": sum(r["steps"] for r in runs), "proposed": proposed, "accepted": accepted,
            "acceptance": accepted / proposed if proposed else None,
            "tokens_per_step": out / sum(r["steps"] for r in runs),
            # /metrics' verification cost: the verifying steps' seconds over the engine's step-time fit's
            # seconds for them without proposals (engine/core.py `_verify_cost`)
            "verify_cost_ratio": (sum(r["verify_step_s"] for r in runs) / plain_s
                                  if (plain_s := sum(r["verify_step_plain_s"] for r in runs)) else None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    engines = {"plain": LLM(kv_cache_memory_gib=0.5), "spec": LLM(kv_cache_memory_gib=0.5, speculative=SPEC),
               "suffix": LLM(kv_cache_memory_gib=0.5, speculative=SUFFIX)}
    for llm in engines.values():
        llm.engine.warmup()
    plain = engines["plain"]
    report: dict = {"model": "demo (SmolLM2-135M-Instruct)", "speculative": SPEC, "suffix": SUFFIX,
                    "max_tokens": a.max_tokens, "rounds": a.rounds, "load_average_at_start": os.getloadavg(),
                    "cpus": os.cpu_count(), "device": str(plain.engine.device), "dtype": str(plain.engine.dtype),
                    "grammar_constrained": sorted(TOOLS), "workloads": {}}
    for name, texts in WORKLOADS.items():
        tools = TOOLS.get(name)
        prompts = [chat_ids(plain, t, tools) for t in texts]
        grammar = grammar_of(plain, tools)
        res: dict = {}
        for mode in ("batch1", f"batch{len(prompts)}"):
            runs: dict = {key: [] for key in engines}
            groups = [[p] for p in prompts] if mode == "batch1" else [prompts]
            for r in range(a.rounds):
                for g in groups:
                    for key, llm in engines.items():
                        runs[key].append(run(llm, g, a.max_tokens, f"{name}-{mode}-{key}-{len(runs[key])}", grammar,
                                             tenant=f"{name}-{mode}-{r}"))
            p = summarize(runs["plain"])
            res[mode] = {"plain": p}
            for key in ("spec", "suffix"):  # "spec" is ngram (the name the JSON has always had)
                s = summarize(runs[key])
                same = all(x["outputs"] == y["outputs"] for x, y in zip(runs["plain"], runs[key]))
                pre = "" if key == "spec" else "suffix_"
                res[mode][key] = s
                res[mode].update({f"{pre}tpot_speedup": p["tpot_ms_median"] / s["tpot_ms_median"],
                                  f"{pre}decode_cpu_per_token_speedup": p["decode_cpu_ms_per_token"] / s["decode_cpu_ms_per_token"],
                                  f"{pre}throughput_ratio": s["output_tok_s"] / p["output_tok_s"],
                                  f"{pre}greedy_outputs_equal": same})
                print(f"{name:10s} {mode:7s} {key:6s} TPOT {p['tpot_ms_median']:6.1f} -> {s['tpot_ms_median']:6.1f} ms "
                      f"(x{res[mode][pre + 'tpot_speedup']:.2f}), CPU/token x{res[mode][pre + 'decode_cpu_per_token_speedup']:.2f}, "
                      f"tok/s {p['output_tok_s']:6.1f} -> {s['output_tok_s']:6.1f}, "
                      f"acceptance {s['acceptance'] if s['acceptance'] is None else round(s['acceptance'], 3)}, "
                      f"tokens/step {s['tokens_per_step']:.2f}, equal {same}", flush=True)
        report["workloads"][name] = res
    report["load_average_at_end"] = os.getloadavg()
    OUT.mkdir(exist_ok=True)
    (OUT / "speculative.json").write_text(json.dumps(report, indent=2))
    plot(report, OUT / "speculative.png")


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(report["workloads"])
    panels = [(m, k) for m in ("batch1", "batch3") for k in ("tpot_ms_median", "decode_cpu_ms_per_token")]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for ax, (mode, key) in zip(axes, panels):
        xs = range(len(names))
        for off, engine, label in ((-0.27, "plain", "plain"), (0, "spec", "ngram, adaptive k"),
                                   (0.27, "suffix", "suffix, adaptive k")):
            vals = [report["workloads"][n][mode][engine][key] for n in names]
            ax.bar([x + off for x in xs], vals, 0.27, label=label)
            for x, n in zip(xs, names):
                acc = report["workloads"][n][mode][engine]["acceptance"]
                if engine != "plain":
                    ax.annotate(f"{acc:.2f}" if acc is not None else "-", (x + off, vals[x]),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), names)
        ax.set_ylabel({"tpot_ms_median": "median TPOT, wall (ms)",
                       "decode_cpu_ms_per_token": "decode CPU time per token (ms)"}[key])
        ax.set_title(f"demo model, {mode}, {report['device']} (labels: acceptance)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
