"""The Ray head restarts and the workers live on (issue 30, item 2), as far as one machine allows.

A cluster of two Ray nodes started with `ray start`, as KubeRay starts its pods: the head
(127.0.N.20) and a worker node (127.0.N.21) holding both pools, with Ray's GCS fault tolerance
on an external redis-server (what the chart's `gcsFaultTolerance` sets: RAY_REDIS_ADDRESS and a
storage namespace) and Ray's token auth on. The app is deployed as the chart's RayService deploys
it (`serve run` of a Serve config naming splitserve.deploy:build_app, its Ingress replicas pinned
to the head by the head's custom resource — so the Controller they create starts there too).
Then the head "pod" dies:
every process of that node (GCS, raylet, Serve's controller and HTTP proxy, whatever ran there)
is SIGKILLed while a stream is in flight through the head's proxy, and it comes back as a new
pod does (a fresh temp dir, the same address, the same Redis and token).

Shown: the client of the stream in flight gets a connection error, not a hang; the worker
processes are the same ones after the restart, re-adopted by the restarted Controller (killed
with the head wherever it ran: Ray's soft affinity puts it on the head unless that is busy); the app
answers again, the same greedy text;
`splitserve status` lists the same workers; and the interrupted stream left nothing on them.

This cluster is the test's own (its own IPs, temp dirs and token), beside the session's."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.loopback import free_port
from tests.loopback import ip
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)

HEAD, NODE = ip(20), ip(21)
ASK = {"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 8, "temperature": 0}


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process here."""
    out = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")
                ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out[int(p)] = (ppid, cmd)
    return out


def node_processes(ip: str, gcs: bool) -> set[int]:
    """A node's processes: those started for its IP (raylet, agents; the GCS on the head) and
    everything they started (Ray's workers rename themselves `ray::...`, so by parentage)."""
    procs = processes()
    # (the head's autoscaler monitor and Ray-client server name it their own ways)
    mine = re.compile(r"(node[-_]ip[-_]address|monitor-ip|client\.server .*--host)=" + re.escape(ip) + r"(\s|$)")
    found = {p for p, (_, cmd) in procs.items() if mine.search(cmd) or (gcs and "gcs_server" in cmd and ip in cmd)}
    grew = True
    while grew:
        # a Ray worker names its raylet in RAY_RAYLET_PID, also once its parent has gone
        # (reparented to init, it is no one's child any more)
        more = {p for p, (ppid, _) in procs.items() if ppid in found or _raylet_of(p) in found} - found
        found |= more
        grew = bool(more)
    return found


def ours(title: str, procs: dict[int, tuple[int, str]] | None = None) -> set[int]:
    """This cluster's processes (either node's) whose command line holds `title`: the other test
    worker runs clusters of its own on this machine at the same time."""
    procs = processes() if procs is None else procs
    return {p for p in node_processes(HEAD, gcs=True) | node_processes(NODE, gcs=False) if title in procs.get(p, (0, ""))[1]}


def _raylet_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for e in env:
        if e.startswith(b"RAY_RAYLET_PID="):
            return int(e.split(b"=", 1)[1] or 0)
    return None


def kill(pids: set[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def alive(pid: int) -> bool:
    try:
        return "ray::" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


class TwoNodeCluster:
    def __init__(self, redis: RedisServer, tmp: Path) -> None:
        self.port, self.tmp = free_port(), tmp
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
                    "RAY_REDIS_ADDRESS": f"127.0.0.1:{redis.port}", "RAY_external_storage_namespace": "head-restart",
                    "RAY_gcs_rpc_server_reconnect_timeout_s": "120", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_ADDRESS": f"{HEAD}:{self.port}"}
        self.heads = 0

    def run(self, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(cmd)}: {done.stdout[-1500:]}{done.stderr[-1500:]}"
        return done

    def start_head(self) -> None:
        """`ray start --head`, each time in a fresh temp dir: a restarted pod's /tmp is new."""
        self.heads += 1
        temp = tempfile.mkdtemp(prefix=f"h{self.heads}", dir=self.tmp)
        env = {k: v for k, v in self.env.items() if k != "RAY_ADDRESS"}
        done = subprocess.run(["ray", "start", "--head", f"--node-ip-address={HEAD}", f"--port={self.port}",
                               "--num-cpus=1", '--resources={"head_node": 1}', "--include-dashboard=false",
                               "--disable-usage-stats",
                               f"--temp-dir={temp}"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]

    def start_worker_node(self) -> None:
        self.run("ray", "start", f"--address={HEAD}:{self.port}", f"--node-ip-address={NODE}", "--num-cpus=3",
                 '--resources={"pool_node": 3}', "--disable-usage-stats")

    def stop(self) -> None:
        kill(node_processes(NODE, gcs=False) | node_processes(HEAD, gcs=True))


def serve_config(path: Path, model: str, http_port: int) -> Path:
    path.write_text(textwrap.dedent(f"""\
        proxy_location: HeadOnly
        http_options: {{host: {HEAD}, port: {http_port}}}
        applications:
          - name: head-restart
            route_prefix: /
            import_path: splitserve.deploy:build_app
            args:
              model: {model}
              name: head-restart
              prefill: 1
              decode: 1
              disagg_min_tokens: 0
              served_model_name: tiny
              prefill_resources: {{pool_node: 1}}
              decode_resources: {{pool_node: 1}}
              engine: {{num_kv_blocks: 256}}
            deployments:
              - name: Ingress
                ray_actor_options: {{num_cpus: 0, resources: {{head_node: 1}}}}
        """))
    return path


def answer(url: str, within_s: float) -> str:
    """The greedy completion, once the app answers (a hang guard, not a bound)."""
    deadline, last = time.monotonic() + within_s, None
    while time.monotonic() < deadline:
        try:
            r = httpx.post(url + "/v1/completions", json=ASK, timeout=30)
            if r.status_code == 200:
                return r.json()["choices"][0]["text"]
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.2)
    raise AssertionError(f"the app did not answer within {within_s:g} s: {last}")


def worker_counts(cluster: TwoNodeCluster, names: list[str]) -> list[dict]:
    """Each worker's block and lease counts (its own invariant check), from a driver of this cluster."""
    code = ("import json, sys, ray; ray.init(address=sys.argv[1], namespace='splitserve', log_to_driver=False); "
            "print(json.dumps([ray.get(ray.get_actor(n).check_invariants.remote()) for n in sys.argv[2:]]))")
    out = cluster.run(sys.executable, "-c", code, f"{HEAD}:{cluster.port}", *names).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_head_restart_keeps_the_workers_and_the_app(tiny_checkpoint, tmp_path):
    tmp = Path(tempfile.mkdtemp(prefix="hr", dir="/tmp"))  # short: Ray's socket paths live under it
    redis = RedisServer()
    if redis.binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis.start()
    cluster = TwoNodeCluster(redis, tmp)
    http_port = free_port()
    url = f"http://{HEAD}:{http_port}"
    try:
        cluster.start_head()
        cluster.start_worker_node()
        cluster.run("serve", "run", "--non-blocking",
                    str(serve_config(tmp_path / "serve.yaml", str(tiny_checkpoint("llama")), http_port)))
        before = answer(url, 180)
        status = json.loads(cluster.run("splitserve", "status", "--name", "head-restart", "--json").stdout)
        ids = sorted(w["id"] for w in status["workers"] if w["state"] == "ready")
        assert len(ids) == 2 and all(w["node_ip"] == NODE for w in status["workers"]), status
        workers = ours("WorkerActor")
        assert len(workers) == 2 and not workers & node_processes(HEAD, gcs=True)
        # the Ingress replica is on the head, and so, as a rule, is the Controller it created
        # (soft affinity: under load Ray may place it on the other node — then it dies with the
        # head all the same, as the worst case: a title may end in .method, and for a moment
        # between calls be something else, so both are looked for until they show)
        deadline = time.monotonic() + 10
        while True:
            head, procs = node_processes(HEAD, gcs=True), processes()
            replica = [p for p in head if procs.get(p, (0, ""))[1].startswith("ray::ServeReplica:head-restart:Ingress")]
            controller = sorted(ours("ray::Controller", procs))
            if replica and len(controller) == 1:
                break
            assert time.monotonic() < deadline, (replica, controller)
            time.sleep(0.2)

        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={**ASK, "max_tokens": 400, "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # the stream is running on the workers
            kill(node_processes(HEAD, gcs=True) | set(controller))  # the head pod dies (with the Controller)
            with pytest.raises(httpx.HTTPError):  # its client: a connection error, not a hang
                for _ in lines:
                    pass
        assert all(alive(p) for p in workers), "a worker died with the head"
        assert not alive(controller[0])  # the Controller that answers next is a restarted one

        cluster.start_head()
        assert answer(url, 180) == before
        assert all(alive(p) for p in workers) and ours("WorkerActor") == workers  # the same processes
        status = json.loads(cluster.run("splitserve", "status", "--name", "head-restart", "--json").stdout)
        assert sorted(w["id"] for w in status["workers"] if w["state"] == "ready") == ids, status
        deadline = time.monotonic() + 60  # the interrupted stream is freed (its replica gone, or cancelled)
        while True:
            counts = worker_counts(cluster, [f"head-restart:{i}" for i in ids])
            if all(c["in_use"] == 0 and c.get("leases", 0) == 0 for c in counts):
                break
            assert time.monotonic() < deadline, counts
            time.sleep(1)
        for c in counts:
            assert c["free"] + c["cached"] == c["total"], c
    finally:
        cluster.stop()
        subprocess.run(["pkill", "-9", "-f", str(tmp)], check=False)  # any it missed: all name the temp dir
        redis.kill()
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
