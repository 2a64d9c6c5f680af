"""The CPU image's install command (deploy/docker/Dockerfile), resolved with --dry-run in a fresh
venv: the package builds its metadata and every pin resolves together. The `pip_dry_run` fixture
(install_check.PipDryRun) started it beside the other tests; the real install is
deploy/docker/check_install.sh."""

from __future__ import annotations

import json
import re
import tomllib

import pytest

from .chart import REPO
from .install_check import DRY_RUN_TEST, PipDryRun

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.slow
def test_cpu_install_command_resolves_in_a_fresh_venv(pip_dry_run: PipDryRun) -> None:
    assert pip_dry_run is not None, f"conftest starts the dry run for a test named {DRY_RUN_TEST}"
    pip_dry_run.wait(timeout=600)
    resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                for i in json.loads(pip_dry_run.report.read_text())["install"]}
    assert resolved["splitserve"] == PYPROJECT["project"]["version"]
    assert resolved["torch"].split("+")[0] == "2.13.0"
    assert tuple(int(x) for x in resolved["ray"].split(".")[:2]) >= (2, 60)
    (target,) = [a for a in pip_dry_run.image_argv if a.startswith("/src")]
    extras = re.fullmatch(r"/src(?:\[([a-z0-9_,-]+)\])?", target).group(1) or ""
    for extra in filter(None, extras.split(",")):
        for req in PYPROJECT["project"]["optional-dependencies"][extra]:
            name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower()
            assert name in resolved, f"extra {extra}: {name} not resolved"
