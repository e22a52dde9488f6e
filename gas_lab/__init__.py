"""gas_lab: gradient accumulation from one device to DDP to ZeRO-1, checked against DeepSpeed."""

from gas_lab.cluster import RankError, RankStallError, start_cluster, stop_cluster
from gas_lab.engine import initialize

__all__ = ["RankError", "RankStallError", "initialize", "start_cluster", "stop_cluster"]
