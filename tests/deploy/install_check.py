"""The CPU image's install command (deploy/docker/Dockerfile, its one `RUN pip install` line),
resolved with --dry-run in a fresh venv while the other tests run."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .chart import DOCKER, REPO

# The test that awaits the dry run; conftest starts the run only when this test is selected.
DRY_RUN_TEST = "test_cpu_install_command_resolves_in_a_fresh_venv"


def pip_install_lines(dockerfile: Path) -> list[list[str]]:
    """Each `RUN pip install ...` instruction of a Dockerfile (continuation lines joined), as argv."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return [shlex.split(line.removeprefix("RUN ")) for line in text.splitlines() if line.startswith("RUN pip install ")]


def copy_source(dest: Path) -> None:
    """The checkout's files (tracked, and untracked but not ignored) copied to dest, as the image's
    `COPY . /src` does: pip's build then writes nothing into the working tree."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, timeout=60)
    if listed.returncode != 0:  # not a git checkout: everything but the usual build output
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
        return
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)


class PipDryRun:
    """The CPU Dockerfile's install command with --dry-run in a fresh venv (pip upgraded first, as
    in the image), /src being a copy of this checkout. It mostly waits on the package index, so it runs
    in a thread beside the other tests; `wait()` gives its result."""

    def __init__(self, workdir: Path) -> None:
        (self.image_argv,) = pip_install_lines(DOCKER / "Dockerfile")
        self.workdir, self.report = workdir, workdir / "report.json"
        self.procs: list[subprocess.Popen] = []
        self.failure: str | None = None
        self.stopped = False
        self._thread = threading.Thread(target=self._run, name="pip-dry-run", daemon=True)
        self._thread.start()

    def _step(self, argv: list[str]) -> bool:
        if self.stopped:
            return False
        # Its own process group, so that stop() also ends pip's build subprocesses.
        proc = subprocess.Popen(argv, cwd=self.workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        self.procs.append(proc)
        out, _ = proc.communicate()
        if proc.returncode != 0:
            self.failure = f"{shlex.join(argv)} -> {proc.returncode}:\n{out[-4000:]}"
        return proc.returncode == 0

    def _run(self) -> None:
        venv, src = self.workdir / "venv", self.workdir / "src"
        py = str(venv / "bin" / "python")
        argv = [a.replace("/src", str(src), 1) if a.startswith("/src") else a for a in self.image_argv]
        try:
            copy_source(src)
        except (OSError, subprocess.SubprocessError) as e:
            self.failure = f"cannot copy the checkout to {src}: {e}"
            return
        (self._step([sys.executable, "-m", "venv", str(venv)])
         and self._step([py, "-m", "pip", "install", "--quiet", "--no-cache-dir", "--upgrade", "pip"])
         and self._step([py, "-m", *argv, "--dry-run", "--quiet", "--report", str(self.report)]))

    def wait(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"pip --dry-run still running after {timeout} s"
        assert self.failure is None, self.failure

    def stop(self) -> None:
        self.stopped = True
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        self._thread.join(30)
