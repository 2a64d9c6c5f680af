"""The RayService path: `serve run` of a Serve config YAML whose application is
`splitserve.deploy:build_app` (what a RayService's serveConfigV2 holds) brings the service up
from nothing — the Controller and both pools included — and serves the OpenAI API and gRPC;
stopping it (Ctrl-C: Serve deletes the app) leaves no Controller and no worker behind."""

import os
import signal
import subprocess
import textwrap
import time

import grpc
import httpx
import pytest

from splitserve import LLM, SamplingParams
from tests.integration.serve_helpers import sees_both_pools
from splitserve.v1 import generation_pb2 as pb
from splitserve.v1 import generation_pb2_grpc as pb_grpc
from tests.loopback import free_port

PROMPT = "A RayService deploys it by import path"


def generate_over_grpc(port: int, within_s: float = 60) -> list:
    """The greedy answer over gRPC, retried while UNAVAILABLE as a client does (a loaded
    machine may let a worker's report go stale for a moment: the app says not ready)."""
    deadline = time.time() + within_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        while True:
            try:
                return list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                    text=PROMPT, sampling=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))))
            except grpc.RpcError as e:
                if e.code() is not grpc.StatusCode.UNAVAILABLE or time.time() > deadline:
                    raise
                time.sleep(0.5)


def test_serve_run_of_a_config_file(ray_session, tiny_checkpoint, tmp_path):
    from splitserve.control import controller

    model = str(tiny_checkpoint("llama"))
    http_port, grpc_port = free_port(), free_port()
    cpus = ray_session.available_resources().get("CPU", 0)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        proxy_location: HeadOnly
        http_options: {{host: 127.0.0.1, port: {http_port}}}
        grpc_options:
          port: {grpc_port}
          grpc_servicer_functions: [splitserve.v1.generation_pb2_grpc.add_GenerationServicer_to_server]
        applications:
          - name: rayservice-test
            route_prefix: /
            import_path: splitserve.deploy:build_app
            args:
              model: {model}
              name: rayservice-test
              prefill: 1
              decode: 1
              disagg_min_tokens: 0
              served_model_name: tiny
              engine: {{num_kv_blocks: 256}}
        """))
    env = {**os.environ, "RAY_ADDRESS": ray_session.address}
    # Into a file, not a pipe: `serve run` streams the cluster's logs, and a pipe nobody reads fills
    # up and blocks it — then it cannot act on Ctrl-C (seen in CI as an app never deleted).
    log_path = tmp_path / "serve-run.log"
    log = log_path.open("w")
    # Ctrl-C must reach it: a test run started in the background (a CI runner, `cmd &` in a script)
    # ignores SIGINT, and an ignored signal stays ignored in every child it starts — then `serve
    # run` never sees the Ctrl-C below (seen here: the app was never deleted).
    proc = subprocess.Popen(["serve", "run", str(cfg)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    tail = lambda: log_path.read_text()[-3000:]  # noqa: E731
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            assert proc.poll() is None, tail()
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(f"the app never became ready:\n{tail()}")
        sees_both_pools(url)
        ref = LLM(model, num_kv_blocks=256).generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                                               ignore_eos=True))[0].outputs[0].text
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
        assert float(r.headers["x-splitserve-transfer-ms"]) > 0  # through a prefill worker
        assert "".join(m.text for m in generate_over_grpc(grpc_port)) == ref
        assert controller.find("rayservice-test") is not None
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: serve run deletes the app
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"serve run did not exit within 60 s of Ctrl-C:\n{tail()}") from None
        deadline = time.time() + 60  # the ingress detached; the Controller stops its workers and exits
        while time.time() < deadline:
            try:
                controller.find("rayservice-test")
            except ValueError:
                break
            time.sleep(0.2)
        with pytest.raises(ValueError, match="no splitserve app"):
            controller.find("rayservice-test")
        while time.time() < deadline and ray_session.available_resources().get("CPU", 0) < cpus:
            time.sleep(0.2)
        assert ray_session.available_resources().get("CPU", 0) >= cpus  # every worker's CPU is back
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        from ray import serve

        serve.shutdown()
