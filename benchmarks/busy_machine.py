"""A server on a busy machine serves slower, it does not stop serving (issue 50, DESIGN.md §4
"Liveness"). Two CPU hogs (`python3 -c "while True: pass"` ×2) run beside `splitserve serve
--prefill 1 --decode 1` on the demo model; from the moment `/ready` says 200, N back-to-back
requests through the `openai` SDK (no retries: every non-200 counts), in turn:

  * plain: a chat completion;
  * structured: a chat completion under `response_format` json_schema (checked: valid JSON of
    the schema);
  * long streamed: a ~3.5K-token prompt, `/v1/completions` streamed; each prompt opens with
    its own number, so no prefix cache spares its prefill.

Counted: non-200 answers (by status and message), each request's latency and first-token time,
how long `/ready` took, and the workers as `splitserve status` saw them (slow / dead / replaced)
during the run. Writes results/busy_machine.json. The hogs and the server (with the Ray
cluster it started, under a RAY_TMPDIR of its own so no other cluster on the machine is met)
are stopped afterwards.

    python benchmarks/busy_machine.py [--requests 50] [--hogs 2] [--port 18200] [--code DIR]

`--code DIR`: the splitserve tree the server runs (default: this one), e.g. another checkout to
compare with.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}


def hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (serve takes its app and the Ray cluster it started down), then SIGKILL to the group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def long_prompt(model: str, tokens: int) -> str:
    from splitserve.text.tokenizer import Tokenizer

    tok = Tokenizer(model)
    words = "the quick brown fox jumps over a lazy dog near the river bank while birds sing".split()
    text, i = [], 0
    while len(tok.encode(" ".join(text))) < tokens:
        text.extend(words[j % len(words)] for j in range(i, i + 64))
        i += 64
    return " ".join(text)


def one(client, kind: str, prompt: str) -> dict:
    import openai

    t0 = time.monotonic()
    out = {"kind": kind, "status": 200, "error": None, "first_token_s": None}
    try:
        if kind == "plain":
            r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Name a colour."}],
                                               max_tokens=16, temperature=0)
            out["tokens"] = r.usage.completion_tokens
        elif kind == "structured":
            r = client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "A city and its population, as JSON."}],
                max_tokens=48, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
            import jsonschema

            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
            out["tokens"] = r.usage.completion_tokens
        else:
            n = 0
            for chunk in client.completions.create(model="demo", prompt=prompt, max_tokens=16, temperature=0,
                                                   stream=True):
                if chunk.choices and chunk.choices[0].text and out["first_token_s"] is None:
                    out["first_token_s"] = round(time.monotonic() - t0, 3)
                n += 1
            out["tokens"] = n
    except openai.APIStatusError as e:
        out.update(status=e.status_code, error=str(e)[:300])
    except Exception as e:  # a broken stream, a timeout, invalid JSON: not a 200 answer either
        out.update(status=None, error=f"{type(e).__name__}: {str(e)[:300]}")
    out["latency_s"] = round(time.monotonic() - t0, 3)
    return out


def watch_status(env: dict, seen: list, stop_at: threading.Event) -> None:
    """`splitserve status --json` every 2 s: which workers went slow, dead, or were replaced."""
    while not stop_at.wait(2.0):
        try:
            p = subprocess.run([sys.executable, "-m", "splitserve.cli.main", "status", "--json"], env=env, cwd=ROOT,
                               capture_output=True, text=True, timeout=30)
            st = json.loads(p.stdout)
        except Exception:  # a late answer on a busy machine: the next one
            continue
        seen.append({"t": round(time.time(), 1),
                     "workers": [(w["id"], w["state"], w.get("slow"), w.get("silent_s"), w.get("reason"))
                                 for w in st["workers"]]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--port", type=int, default=18200)
    ap.add_argument("--prompt-tokens", type=int, default=3500)
    ap.add_argument("--start-timeout-s", type=float, default=900)
    ap.add_argument("--out", default=str(ROOT / "results" / "busy_machine.json"))
    ap.add_argument("--code", default=str(ROOT), help="the splitserve tree the server runs")
    a = ap.parse_args()

    import openai

    from splitserve.engine.model.demo import ensure_demo_model

    model = str(ensure_demo_model(progress=False))
    prompt = long_prompt(model, a.prompt_tokens)
    tmp = tempfile.mkdtemp(prefix="bm", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_TMPDIR": tmp, "PYTHONPATH": a.code}
    cmd = [sys.executable, "-m", "splitserve.cli.main", "serve", "--prefill", "1", "--decode", "1",
           "--port", str(a.port), "--grpc-port", str(a.port + 1), "--served-model-name", "demo"]
    busy = hogs(a.hogs)
    log = open(Path(tmp) / "serve.log", "w")
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen: list = []
    done = threading.Event()
    results: list[dict] = []
    try:
        ready_s = wait_ready(f"http://127.0.0.1:{a.port}/ready", server, a.start_timeout_s)
        watcher = threading.Thread(target=watch_status, args=(env, seen, done), daemon=True)
        watcher.start()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{a.port}/v1", api_key="none", max_retries=0,
                               timeout=600)
        started = time.monotonic()
        for i in range(a.requests):
            kind = ("plain", "structured", "long_streamed")[i % 3]
            results.append(one(client, kind, f"{i}. {prompt}"))
            r = results[-1]
            print(f"{i:3d} {kind:14s} {r['status']} {r['latency_s']:7.2f} s {r['error'] or ''}", flush=True)
        wall_s = time.monotonic() - started
    finally:
        done.set()
        stop(server)
        for h in busy:
            h.kill()
            h.wait()
    bad = [r for r in results if r["status"] != 200]
    by_kind = {k: sorted(r["latency_s"] for r in results if r["kind"] == k)
               for k in ("plain", "structured", "long_streamed")}
    summary = {"requests": len(results), "non_200": len(bad), "ready_after_s": round(ready_s, 1),
               "wall_s": round(wall_s, 1), "hogs": a.hogs, "cpus": os.cpu_count(), "code": a.code,
               "latency_p50_s": {k: v[len(v) // 2] for k, v in by_kind.items() if v},
               "latency_max_s": {k: v[-1] for k, v in by_kind.items() if v},
               "workers_ever_slow": sorted({w[0] for s in seen for w in s["workers"] if w[2]}),
               "workers_dead": sorted({w[0] for s in seen for w in s["workers"] if w[1] == "dead"})}
    print(json.dumps(summary, indent=1))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": cmd, "summary": summary, "results": results, "status": seen}, indent=1))


if __name__ == "__main__":
    main()
