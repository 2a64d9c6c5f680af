"""Fixtures of the deployment tests (helpers in chart.py, install_check.py, k8s_checks.py).

Without helm the tests fail, loudly: only SPLITSERVE_OFFLINE=1 turns a missing helm into a skip.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml

from .chart import CASES, Case, HelmUnavailable, Rendered, helm_binary, helm_template
from .install_check import DRY_RUN_TEST, PipDryRun


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        exe = helm_binary()
    except HelmUnavailable as e:
        if os.environ.get("SPLITSERVE_OFFLINE") == "1":
            pytest.skip(f"SPLITSERVE_OFFLINE=1 and no helm: {e}")
        pytest.fail(f"cannot get helm: {e}")
    version = subprocess.run([str(exe), "version", "--short"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("v3."), f"{exe} does not run: {version}"
    return exe


@pytest.fixture(scope="session")
def render(helm: Path) -> Callable[[Case], Rendered]:
    """render(case) -> the chart's objects for that case (rendered once per session)."""
    done: dict[Case, Rendered] = {}

    def get(case: Case) -> Rendered:
        if case not in done:
            proc = helm_template(helm, case)
            assert proc.returncode == 0, f"helm template {case.name} failed:\n{proc.stderr}"
            done[case] = Rendered(case, [d for d in yaml.safe_load_all(proc.stdout) if d])
        return done[case]

    return get


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def rendered(request, render) -> Rendered:
    return render(request.param)


@pytest.fixture(scope="session", autouse=True)
def pip_dry_run(request, tmp_path_factory) -> Iterator[PipDryRun | None]:
    """Started with the first deploy test when the dry-run test is selected at all: it mostly
    waits on the package index, so it runs beside the other tests."""
    if not any(item.name == DRY_RUN_TEST for item in request.session.items):
        yield None
        return
    run = PipDryRun(tmp_path_factory.mktemp("pip-dry-run"))
    yield run
    run.stop()
