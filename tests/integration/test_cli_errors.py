"""Every failure of `splitserve status` / `scale` from a second shell is one line on stderr in our
words, naming what to do, with a non-zero exit, and no traceback unless `--debug`: bad arguments,
no cluster at the address, no app of that name, and a cluster with Ray's token authentication
that refuses this process's token (a real `ray start --head` with a token of its own)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from tests.loopback import ip
from tests.loopback import free_port

HEAD = ip(20)  # a `ray start` head of its own, on this xdist worker's loopback net

pytestmark = pytest.mark.timeout(120)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["splitserve", *args], capture_output=True, text=True, timeout=90,
                          env={**os.environ, **(env or {})})


def one_line_error(run: subprocess.CompletedProcess, command: str, code: int = 1) -> str:
    assert run.returncode == code, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert lines[0].startswith(f"splitserve {command}: error: "), lines[0]
    return lines[0].split(": error: ", 1)[1]


def test_a_bad_argument_is_one_line():
    why = one_line_error(cli("scale", "--prefill", "two"), "scale", code=2)
    assert why == "argument --prefill: invalid int value: 'two' (see `splitserve scale --help`)"
    why = one_line_error(cli("scale"), "scale")
    assert why == "say --prefill N and/or --decode M"


def test_no_cluster_at_the_address_says_how_to_start_one():
    port = free_port()  # nothing listens there
    why = one_line_error(cli("status", "--address", f"127.0.0.1:{port}"), "status")
    assert why == (f"cannot reach a Ray cluster at 127.0.0.1:{port} (Connection refused): start one with "
                   "`splitserve serve`, or name a running one with --address HOST:PORT")
    debug = cli("status", "--address", f"127.0.0.1:{port}", "--debug")
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


def test_no_app_of_that_name(ray_session):
    why = one_line_error(cli("status", "--address", ray_session.address, "--name", "no-such-app"), "status")
    assert why == "no splitserve app 'no-such-app' is running on this Ray cluster (namespace 'splitserve')"
    why = one_line_error(cli("scale", "--address", ray_session.address, "--name", "no-such-app", "--decode", "2"),
                         "scale")
    assert why.startswith("no splitserve app 'no-such-app'")


@pytest.fixture(scope="module")
def token_cluster():
    """A Ray head with token authentication and a token of its own; (address, token)."""
    token, port, tmp = secrets.token_hex(16), free_port(), tempfile.mkdtemp(prefix="ssauth", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "HOME": tmp}
    head = subprocess.Popen(["ray", "start", "--head", "--block", "--port", str(port), "--node-ip-address",
                             HEAD, "--num-cpus", "0", "--include-dashboard=false", "--temp-dir", f"{tmp}/r"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection((HEAD, port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None, "ray start --head failed"
                time.sleep(0.3)
        time.sleep(1.0)  # the GCS listens a moment before it serves
        yield f"{HEAD}:{port}", token
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the head and the processes it started
        head.wait(10)
        subprocess.run(["pkill", "-9", "-f", tmp], check=False)  # any that left its process group
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("given", ["a wrong token", "no token"])
def test_a_cluster_that_refuses_the_token_says_where_the_token_goes(token_cluster, given, tmp_path):
    address, token = token_cluster
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32} if given == "a wrong token" else \
        {"HOME": str(tmp_path)}
    if given == "no token":
        env["RAY_AUTH_MODE"] = ""  # as in a fresh shell: Ray decides from the token files it finds (none here)
    why = one_line_error(cli("status", "--address", address, env=env), "status")
    assert why == (f"the Ray cluster at {address} refused this process's authentication token: run it where the "
                   "cluster's token is readable (~/.ray/auth_token), or set RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN to "
                   "the cluster's token")
    if given == "a wrong token":  # and the right one gets in (and finds no app there)
        right = cli("status", "--address", address, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
        assert one_line_error(right, "status").startswith("no splitserve app 'splitserve'")
