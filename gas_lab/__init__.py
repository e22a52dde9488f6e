"""gas_lab: gradient accumulation from one device to DDP and ZeRO, checked against DeepSpeed."""

from gas_lab.deepspeed_compat.engine import initialize
from gas_lab.runtime.build_lock import use_environment_cache
from gas_lab.runtime.cluster import RankError, RankStallError, start_cluster, stop_cluster

use_environment_cache()  # DeepSpeed builds its C++ ops in this environment's own folder

__all__ = ["RankError", "RankStallError", "initialize", "start_cluster", "stop_cluster"]
