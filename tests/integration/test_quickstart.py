"""The README's quick start as a new user runs it: the real `splitserve serve` on the demo model,
and the README's own chat curl body, sent as it is (no max_tokens). The demo model samples at
temperature 0.2 and often never ends on its own: the model's generation_config.json
max_new_tokens bounds every answer, so each request finishes in seconds.

The server runs in-process (`--prefill 0 --decode 0`): the request defaults live in the
ingress's Frontend, which the Ray app shares (tests/integration/test_serve_app.py checks them
through a cluster)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tests.loopback import free_port

README = Path(__file__).parents[2] / "README.md"


def readme_chat_body() -> dict:
    """The JSON body of the README's first chat-completions curl."""
    text = README.read_text()
    m = re.search(r"curl localhost:8000/v1/chat/completions[^`]*?-d '(\{.*?\})'", text, re.S)
    assert m, "the README has no chat-completions curl"
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def served_demo(demo_model_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = log_path.open("w")  # a file, not a pipe nobody reads (a full one would block the server)
    proc = subprocess.Popen(["splitserve", "serve", "--model", str(demo_model_dir),
                             "--prefill", "0", "--decode", "0", "--port", str(port), "--grpc-port", str(free_port())],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise AssertionError("splitserve serve never became ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_the_readme_chat_curl_finishes_bounded_by_the_models_default(served_demo, demo_model_dir):
    body = readme_chat_body()
    assert "max_tokens" not in body and "max_completion_tokens" not in body  # what a new user sends
    default = json.loads((demo_model_dir / "generation_config.json").read_text())["max_new_tokens"]

    def ask(_):
        return httpx.post(served_demo + "/v1/chat/completions", json=body, timeout=300)

    with ThreadPoolExecutor(10) as pool:  # 10 tries, batched together on the engine
        answers = list(pool.map(ask, range(10)))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    finishes = [(r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"]) for r in answers]
    assert all(reason in ("stop", "length") for reason, _ in finishes), finishes
    assert max(n for _, n in finishes) <= default, finishes
    assert all(n == default for reason, n in finishes if reason == "length"), finishes
