"""The ``%%ranks`` cell magic: run a whole cell on every rank, variables persisting (lesson 00),
and ``%ranks_status``: each rank's pid, device, memory and state (``cluster.status()``).

``%%ranks``, ``%%ranks --timeout 300``, ``%%ranks --rank 0`` (or ``--rank 0,1``: those ranks
only). A mistake on the magic's line is a one-line error naming the option, raised before
anything runs on the ranks.
"""

from __future__ import annotations

import sys

from gas_lab.runtime.arguments import parse_ranks_line


def cell_name(ip) -> str:
    """How IPython names the running cell in tracebacks (``In[7]``): the name of the code that
    called the magic. (``ip.execution_count`` has already moved on to the next cell by then.)"""
    frame = sys._getframe(1)
    while frame is not None:
        named = ip.compile.format_code_name(frame.f_code.co_filename)
        if named:
            return named[1]
        frame = frame.f_back
    return f"In[{ip.execution_count}]"


def register_magic(get_cluster, default_timeout: float) -> None:
    """Register ``%%ranks`` and ``%ranks_status`` in the running IPython, on ``get_cluster()``."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return

    def ranks(line: str, cell: str) -> None:
        __tracebackhide__ = True
        timeout, chosen = parse_ranks_line(line, default_timeout)
        get_cluster().execute(cell, timeout=timeout, cell=cell_name(ip), ranks=chosen)

    def ranks_status(line: str):
        return get_cluster().status()

    ip.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
    ip.register_magic_function(ranks_status, magic_kind="line", magic_name="ranks_status")
