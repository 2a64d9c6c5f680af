"""A Ray cluster we started is noted on this machine only while it lives (issue 50): the README's
`Cluster` API used twice in one process — the second time while it serves, the process is
SIGKILLed — then again in a new process: every start serves, none fails with "cannot reach a
Ray cluster" at the address of one that ended (three starts: the least that shows both).

Outside the suite's shared cluster: each process is a new user's shell — no RAY_* variable
(Ray's defaults, token authentication on), its own HOME (the token Ray writes) and RAY_TMPDIR
(where clusters are noted), so the shared cluster is neither found nor touched."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

SERVE = """
import os, signal, sys
from splitserve import Cluster, SamplingParams

model, runs, then = sys.argv[1], int(sys.argv[2]), sys.argv[3]
note = os.path.join(os.environ["RAY_TMPDIR"], "ray", "ray_current_cluster")
for i in range(runs):
    with Cluster.start(model=model, prefill=0, decode=1, transport="tcp", num_kv_blocks=64) as c:
        out = c.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4))
        print(f"served {len(out[0].outputs[0].token_ids)} tokens, noted {os.path.exists(note)}", flush=True)
    print(f"ended, noted {os.path.exists(note)}", flush=True)
if then == "kill":
    c = Cluster.start(model=model, prefill=0, decode=1, transport="tcp", num_kv_blocks=64)
    out = c.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4))
    print(f"served {len(out[0].outputs[0].token_ids)} tokens, noted {os.path.exists(note)}; SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def a_fresh_shell(home: Path, ray_tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # Ray's defaults: token auth on
    return {**env, "HOME": str(home), "RAY_TMPDIR": str(ray_tmp)}


def gone(address: str, bound_s: float = 30.0) -> bool:
    """Whether nothing answers at `address` (the kernel takes the killed driver's Ray processes
    down with it, on a busy machine not in the same instant)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
        except OSError:
            return True
        time.sleep(0.2)
    return False


def run(model: str, runs: int, then: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SERVE, model, str(runs), then], env=env, capture_output=True,
                          text=True, timeout=240)


def test_cluster_start_twice_then_after_a_killed_one_serves(tiny_checkpoint, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths live under it
    env, model = a_fresh_shell(home, ray_tmp), str(tiny_checkpoint("llama"))
    note = ray_tmp / "ray" / "ray_current_cluster"
    try:
        first = run(model, 1, "kill", env)
        assert first.returncode == -9, first.stderr[-3000:]
        assert first.stdout.splitlines() == ["served 4 tokens, noted True", "ended, noted False",
                                           "served 4 tokens, noted True; SIGKILL"], first.stderr[-3000:]
        left = note.read_text()  # the fault landed: the killed cluster's note stayed, and its GCS went with it
        assert gone(left), f"the killed cluster's GCS at {left} still answers"

        after = run(model, 1, "-", env)
        assert after.returncode == 0, after.stderr[-3000:]
        assert after.stdout.splitlines() == ["served 4 tokens, noted True", "ended, noted False"], after.stderr[-3000:]
        notices = [x for x in after.stderr.splitlines() if x.startswith("splitserve:")]
        assert notices == [f"splitserve: ignoring the Ray cluster noted at {left} (Connection refused): it ended "
                           f"without removing its note"], after.stderr[-3000:]
        assert not processes_of(ray_tmp), "a Ray process of these clusters outlived them"
    finally:
        for pid in processes_of(ray_tmp, bound_s=0):
            os.kill(pid, 9)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def processes_of(ray_tmp: Path, bound_s: float = 30.0) -> list[int]:
    """The processes still running for clusters noted under `ray_tmp` (Ray's nodes name their
    session directory there), once those ending have had `bound_s` to exit."""
    deadline = time.monotonic() + bound_s
    while True:
        ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines()
        pids = [int(line.split()[0]) for line in ps if str(ray_tmp) in line and "ps -eo" not in line]
        if not pids or time.monotonic() >= deadline:
            return pids
        time.sleep(0.5)
