"""A script that brings a cluster up with `Cluster.start(..., transport="nixl")`, generates and
exits leaves nothing on its stderr: no nanobind leak report, no task destroyed pending, no
traceback — from itself or, streamed to it by Ray (log_to_driver), from the Controller and the
workers it started."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import HEAD_IP

pytest.importorskip("nixl")

NOISE = ("nanobind", "leaked", "Task was destroyed", "Traceback", "Exception ignored", "was never awaited")


def test_a_nixl_cluster_script_exits_quietly(ray_session, tiny_checkpoint, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""\
        import ray
        ray.init(address={ray_session.address!r}, _node_ip_address={HEAD_IP!r}, log_to_driver=True,
                 logging_level="WARNING")
        from splitserve import SamplingParams
        from splitserve.orchestrator import Cluster

        with Cluster.start(model={str(tiny_checkpoint("llama"))!r}, transport="nixl", disagg_min_tokens=0,
                           num_kv_blocks=64) as c:
            out = c.generate(["the handoff moves over NIXL"], SamplingParams(max_tokens=4, temperature=0))
        print("generated", len(out[0].outputs[0].token_ids))
        """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0 and "generated 4" in run.stdout, run.stderr[-3000:]
    noisy = [line for line in run.stderr.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, "\n".join(noisy)
