"""The CLI reaches the app it started, with Ray's default token authentication on (issue 30): a
new user runs `splitserve serve` in one shell (it starts a local Ray, which turns token auth on
and writes the user's token), then `splitserve scale` and `splitserve status` in another —
nothing set by hand, no RAY_AUTH_MODE anywhere. A process without the token is refused, which
shows the cluster's auth really is on.

Ray's state for this cluster lives in its own RAY_TMPDIR and the user's token in its own HOME,
so the test's shared cluster (which runs with auth off) is neither found nor touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.loopback import free_port

pytestmark = pytest.mark.timeout(300)


def a_fresh_shell(home: Path, ray_tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # Ray's defaults: token auth on
    return {**env, "HOME": str(home), "RAY_TMPDIR": str(ray_tmp)}


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["splitserve", *args], env=env, capture_output=True, text=True, timeout=120)


def test_scale_and_status_reach_the_app_serve_started(tiny_checkpoint, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths live under it
    env = a_fresh_shell(home, ray_tmp)
    port, model = free_port(), str(tiny_checkpoint("llama"))  # what model it serves does not matter here
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        serve = subprocess.Popen(["splitserve", "serve", "--model", model, "--prefill", "0",
                                  "--decode", "1", "--port", str(port), "--grpc-port", str(free_port())],
                                 env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 180
            while True:
                assert serve.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "splitserve serve never became ready: " + log_path.read_text()[-3000:]
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            assert (home / ".ray" / "auth_token").is_file()  # Ray turned token auth on and wrote the token
            # where `ray start` notes its cluster, serve noted the one it started: with another Ray
            # cluster on this machine (the tests' own), "auto" still finds this one
            noted = ray_tmp / "ray" / "ray_current_cluster"
            assert noted.is_file()

            scaled = cli("scale", "--prefill", "1", env=env)
            assert scaled.returncode == 0, scaled.stderr
            assert scaled.stdout.strip() == "targets: prefill 1, decode 1"
            status = cli("status", env=env)
            assert status.returncode == 0, status.stderr
            assert status.stdout.startswith("targets: prefill 1, decode 1") and "decode" in status.stdout

            stranger = tmp_path / "stranger"
            stranger.mkdir()
            refused = cli("status", env={**env, "HOME": str(stranger)})
            assert refused.returncode == 1 and "authentication token" in refused.stderr, refused.stderr
            assert "Traceback" not in refused.stderr
        finally:
            serve.terminate()  # its SIGTERM handler stops the app and the Ray it started
            try:
                serve.wait(90)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait(10)
            forgotten = not (ray_tmp / "ray" / "ray_current_cluster").exists()
            shutil.rmtree(ray_tmp, ignore_errors=True)
        assert forgotten, "serve left its stopped cluster noted as the one running here"
