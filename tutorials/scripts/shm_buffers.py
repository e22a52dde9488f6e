"""The shared memory DeepSpeed's CPU communication op leaves behind, removed by the rank that made it.

Under the ``deepspeed`` launcher on one machine (it sets ``LOCAL_SIZE`` equal to the world size),
DeepSpeed 0.19.8's CPU op (``deepspeed_shm_comm``, ``ops/csrc/cpu/comm/shm.cpp``) creates one
file per rank, ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``
(69,206,024 bytes, 66 MiB), and never unlinks it: it stays in RAM until the machine reboots.
Under ``torchrun`` (no ``LOCAL_SIZE``) none is created. The course's scripts call
:func:`remove_own_buffer` as they end, after every rank has mapped every other's buffer
(``deepspeed.initialize`` waits for that), so removing the name frees the memory at exit and
changes nothing for the ranks still running.
"""

import os
from pathlib import Path

SHM = Path("/dev/shm")  # where Linux keeps shm_open's names


def own_buffer(rank: int) -> Path:
    """This rank's buffer, named as shm.cpp names it (user id, master address and port, rank)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return SHM / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def remove_own_buffer(rank: int) -> bool:
    """Unlink this rank's buffer, if DeepSpeed made one; only this rank's, so a job on another
    port keeps its own. True if there was one."""
    try:
        own_buffer(rank).unlink()
    except FileNotFoundError:
        return False
    return True
