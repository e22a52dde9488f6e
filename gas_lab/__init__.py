"""gas_lab: gradient accumulation from one device to DDP and ZeRO, checked against DeepSpeed."""

from gas_lab.deepspeed_compat.engine import initialize
from gas_lab.runtime.cluster import RankError, RankStallError, start_cluster, stop_cluster

__all__ = ["RankError", "RankStallError", "initialize", "start_cluster", "stop_cluster"]
