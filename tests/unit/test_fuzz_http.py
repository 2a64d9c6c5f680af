"""The HTTP ingress under schemathesis: cases generated from its own /openapi.json (valid and
invalid bodies, odd headers and types) against the real frontend and a real tiny engine. No
case may get a 5xx, an answer outside the document (status, content type, body schema), or
leave the engine holding a request or a block. The long run: benchmarks/fuzz_http.py."""

import collections

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from splitserve.config import EngineConfig  # noqa: E402
from splitserve.orchestrator.local_backend import LocalBackend  # noqa: E402
from splitserve.ingress.http import OpenAIServer  # noqa: E402

# per operation and mode (valid, invalid): about 250 cases in all over the 4 generating routes,
# ~30 s on 2 cores; the long run (benchmarks/fuzz_http.py) takes tens of thousands
CASES_PER_OPERATION = 50
MIN_CASES = 200
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    # A short context keeps the biggest fan-out a case can ask for (256 × n) to a moment's work.
    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=512, max_model_len=32)
    return OpenAIServer(LocalBackend(cfg, model_name="tiny"))


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_asgi("/openapi.json", server.app)


schema = schemathesis.pytest.from_fixture("api")
STATUSES: collections.Counter = collections.Counter()  # of every case the test above ran


def test_the_document_names_every_route_and_method(server):
    """A route added to the app but not to openapi.py would never be fuzzed: the two agree."""
    import httpx
    import asyncio

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as c:
            return (await c.get("/openapi.json")).json()

    doc = asyncio.run(get())
    served = {(r.path, m.lower()) for r in server.app.routes for m in r.methods - {"HEAD"}}
    assert {(p, m) for p, ops in doc["paths"].items() for m in ops} == served


@schema.parametrize()
@settings(max_examples=CASES_PER_OPERATION, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_no_generated_request_breaks_the_server(case, server):
    answered = case.call_and_validate(checks=CHECKS)
    STATUSES[answered.status_code] += 1
    eng = server.backend.engine
    assert not eng.has_unfinished() and eng.pool.num_in_use == 0, "a finished call left work in the engine"
    eng.check_invariants()


def test_the_run_was_as_large_as_promised():
    """Runs after the fuzz test (file order): it made at least MIN_CASES calls, and the calls
    reached generation (200s) as well as validation (4xx)."""
    print("fuzz statuses:", dict(sorted(STATUSES.items())))
    assert sum(STATUSES.values()) >= MIN_CASES, STATUSES
    assert STATUSES[200] >= 100 and STATUSES[400] >= 100, STATUSES
