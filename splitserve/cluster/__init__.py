"""Cluster driver: pools of prefill and decode workers on Ray (`Cluster.start`)."""

from splitserve.cluster.cluster import Cluster, ClusterConfig, PrefillFailed

__all__ = ["Cluster", "ClusterConfig", "PrefillFailed"]
