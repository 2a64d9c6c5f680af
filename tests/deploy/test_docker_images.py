"""The images (deploy/docker): the CPU image's one install command resolves, in a fresh venv,
to what the package pins (the real install: deploy/docker/check_install.sh); both images run as
the user the chart's pods run as and agree with the chart on the Ray version."""

from __future__ import annotations

import re
import tomllib

import yaml

from .chart import CHART, DOCKER, REPO
from .install_check import pip_install_lines

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def _extras(argv: list[str]) -> set[str]:
    (target,) = [a for a in argv if a.startswith("/src")]
    m = re.fullmatch(r"/src(?:\[([a-z0-9_,-]+)\])?", target)
    assert m, target
    return set(filter(None, (m.group(1) or "").split(",")))


def test_cpu_install_command() -> None:
    # One line: deploy/docker/check_install.sh and test_pip_resolve.py run exactly it.
    (argv,) = pip_install_lines(DOCKER / "Dockerfile")
    assert argv[:2] == ["pip", "install"] and "--no-cache-dir" in argv
    assert _extras(argv) <= set(EXTRAS) and "gpu" not in _extras(argv)
    text = (DOCKER / "Dockerfile").read_text()
    assert [l for l in text.splitlines() if l.startswith("FROM ")] == ["FROM python:3.11-slim"]
    assert "ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in text


def test_cuda_image_installs_the_gpu_extra() -> None:
    (package,) = pip_install_lines(DOCKER / "Dockerfile.cuda")
    assert "--no-cache-dir" in package and _extras(package) <= set(EXTRAS) and "gpu" not in _extras(package)
    # The gpu extra goes second, its list read from pyproject, built against the installed torch.
    text = (DOCKER / "Dockerfile.cuda").read_text()
    assert "['optional-dependencies']['gpu']" in text and "--no-build-isolation -r /tmp/gpu-requirements.txt" in text
    assert "gpu" in EXTRAS


def test_images_and_chart_agree() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    ray_version = values["rayVersion"]
    import ray

    assert ray.__version__.split(".")[:2] == ray_version.split(".")[:2]  # the Ray tests run with
    base = re.search(r"^ARG BASE_IMAGE=rayproject/ray:([0-9.]+)-py311-", (DOCKER / "Dockerfile.cuda").read_text(), re.M)
    assert base and base.group(1) == ray_version
    uid, gid = values["podSecurityContext"]["runAsUser"], values["podSecurityContext"]["runAsGroup"]
    for name in ("Dockerfile", "Dockerfile.cuda"):
        lines = (DOCKER / name).read_text().splitlines()
        users = [l for l in lines if l.startswith("USER ")]
        assert users[-1] == f"USER {uid}:{gid}", name  # numeric: the kubelet can check runAsNonRoot
        last_run = max(i for i, l in enumerate(lines) if l.startswith("RUN "))
        assert lines.index(users[-1]) > last_run, f"{name}: nothing may run as root after USER"
        assert "EXPOSE 8000 50051 8265" in lines, name
        assert any(l.startswith("CMD [") for l in lines), name
        # The demo model is resolved on the head and loaded by the workers at one path.
        assert any(l.startswith("ENV SPLITSERVE_CACHE=") for l in lines), name
    # KubeRay's probes run wget: Ray's image has it, the slim one installs it.
    assert "wget" in (DOCKER / "Dockerfile").read_text()


def test_check_install_script_reads_the_same_line() -> None:
    script = (DOCKER / "check_install.sh").read_text()
    assert "'s/^RUN \\(pip install .*\\)$/\\1/p'" in script
    assert script.startswith("#!/usr/bin/env bash")
