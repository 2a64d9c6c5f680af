"""The test session's Ray nodes, started by a process of their own (`python tests/ray_nodes.py
SPEC`): Ray forks each node process from the process that starts it and runs Python in the child
before exec, and a pytest worker that earlier tests left with gRPC threads can fork a child that
is stuck before exec — CI saw a head whose GCS, and another whose raylet, never came up, failing
every Ray test of that worker. This process has no such threads. It prints the cluster's address,
then holds the nodes until its stdin closes (the session ended, or its pytest worker died)."""

from __future__ import annotations

import json
import sys


def main() -> int:
    from ray.cluster_utils import Cluster

    spec = json.loads(sys.argv[1])  # {"head": {...add_node args}, "nodes": [{...}, ...]}
    cluster = Cluster(initialize_head=True, head_node_args=spec["head"])
    try:
        for node in spec["nodes"]:
            cluster.add_node(**node)
        print(cluster.address, flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
