"""A real Prometheus (Debian's `prometheus` package) for the tests: scrapes one target's
/metrics every second into a throw-away TSDB and answers PromQL on its HTTP API."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from tests.loopback import free_port


class PrometheusServer:
    def __init__(self, workdir: Path, target: str, bearer: str | None = None) -> None:
        self.binary = shutil.which("prometheus")
        self.workdir, self.target, self.bearer = workdir, target, bearer
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        auth = f"    authorization: {{type: Bearer, credentials: {self.bearer}}}\n" if self.bearer else ""
        config = self.workdir / "prometheus.yml"
        config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                          "scrape_configs:\n"
                          "  - job_name: splitserve\n"
                          f"    static_configs: [{{targets: ['{self.target}']}}]\n" + auth)
        self.log = (self.workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen([self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("prometheus did not start: " + (self.workdir / "prometheus.log").read_text()[-2000:])

    def target_up(self) -> bool:
        """Whether its last scrape of the target succeeded."""
        r = httpx.get(self.url + "/api/v1/targets", timeout=5).json()
        return any(t["health"] == "up" for t in r["data"]["activeTargets"])

    def query(self, expr: str) -> list[dict]:
        """The instant vector of `expr` now (raises on a PromQL error)."""
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        if r["status"] != "success":
            raise AssertionError(f"{expr}: {r.get('error')}")
        return r["data"]["result"]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None
            self.log.close()
