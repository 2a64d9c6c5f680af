"""The long fuzz run: schemathesis cases from the server's own /openapi.json against the real
HTTP frontend over a real tiny engine (random-init Llama shape, built here as the tests build
it), valid and invalid bodies for every operation, with the checks of
tests/unit/test_fuzz_http.py (no 5xx, status / content type / body as documented, the engine
idle after every call). Writes the status counts and every failure to results/fuzz_http.json.

    python benchmarks/fuzz_http.py [--cases 20000]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' tiny checkpoint and checks

import schemathesis  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from splitserve.config import EngineConfig  # noqa: E402
from splitserve.orchestrator.local_backend import LocalBackend  # noqa: E402
from splitserve.ingress.http import OpenAIServer  # noqa: E402
from tests.tiny_models import build_checkpoint  # noqa: E402
from tests.unit.test_fuzz_http import CHECKS  # noqa: E402

RESULTS = ROOT / "results"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=20000, help="cases in all, spread over the two POST operations")
    ap.add_argument("--out", type=Path, default=RESULTS / "fuzz_http.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint("llama", Path(tmp))
        server = OpenAIServer(LocalBackend(EngineConfig(model=str(model), num_kv_blocks=512, max_model_len=32),
                                           model_name="tiny"))
        args.out.parent.mkdir(exist_ok=True)
        report = fuzz(server, args.cases, args.out)
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=2))
    print(f"{len(report['failures'])} failures; written to {args.out}")


CHUNK = 250  # examples per hypothesis run: its cost per case grows with a run's length, so many short runs


def fuzz(server: OpenAIServer, cases: int, out: Path | None = None) -> dict:
    """Rounds over every operation and mode, CHUNK examples each (fresh random draws every
    round), until `cases` calls were made; the report is rewritten after each round."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", server.app)
    statuses: collections.Counter = collections.Counter()
    failures: list[dict] = []
    eng = server.backend.engine
    began = time.monotonic()
    operations = [r.ok() for r in schema.get_all_operations()]
    report: dict = {}
    while sum(statuses.values()) < cases:
        for op in operations:
            for mode in GenerationMode:
                _run(op, mode, CHUNK if op.method.upper() == "POST" else 10, statuses, failures, eng)
        total = sum(statuses.values())
        report = {"cases": total, "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
                  "server_errors": sum(v for k, v in statuses.items() if isinstance(k, int) and k >= 500),
                  "wall_s": round(time.monotonic() - began, 1), "failures": failures}
        print(f"{total} cases, {len(failures)} failures, {report['wall_s']} s", flush=True)
        if out is not None:
            out.write_text(json.dumps(report, indent=2))
    return report


def _run(op, mode, n: int, statuses, failures, eng) -> None:
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def one(case) -> None:
        try:
            statuses[case.call_and_validate(checks=CHECKS).status_code] += 1
            if eng.has_unfinished() or eng.pool.num_in_use:
                raise AssertionError("a finished call left work in the engine")
            eng.check_invariants()
        except BaseException as e:  # recorded (a check's failures come as a group), and the run goes on
            if isinstance(e, KeyboardInterrupt):
                raise
            statuses["failed"] += 1
            failures.append({"operation": op.label, "mode": mode.value, "error": str(e)[:2000],
                             "trace": traceback.format_exc(limit=3)[-2000:]})

    try:
        one()
    except Unsatisfiable:  # no invalid case exists for this operation (a GET without parameters)
        pass


if __name__ == "__main__":
    main()
