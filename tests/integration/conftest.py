import os

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test run (starting one costs ~3 s and ~0.7 GB)."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
