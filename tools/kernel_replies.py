"""Headless notebook runs wait for a kernel's messages in one-second polls, not one long poll.

``make test`` (nbmake) and ``make course`` (tools/run_course.py) run the notebooks with nbclient,
which waits for a cell's reply with a single zmq poll as long as the cell timeout (600 s here).
pyzmq's asyncio poll wakes when the socket's file descriptor signals, and that signal fires once:
if something else saw it first (anything that reads the socket's ``EVENTS`` does), the poll
sleeps on although the reply has arrived, until its timeout ends and one last check finds the
reply. The cell then passes, 600 s late: lesson 01, after its widget cell, in 3 of 8 parallel
runs of ``make test``. A poll that ends every second looks at the socket again, so a missed
signal costs at most a second. :func:`install` swaps jupyter_client's wait for this one.
"""

from __future__ import annotations

from queue import Empty
from time import monotonic

from jupyter_client.channels import AsyncZMQSocketChannel

SLICE_S = 1.0  # the longest a message can sit unseen in the socket
JUPYTER_GET_MSG = AsyncZMQSocketChannel.get_msg  # jupyter_client's own, for comparison


async def get_msg(self, timeout: float | None = None) -> dict:
    """``AsyncZMQSocketChannel.get_msg``, polling in slices of :data:`SLICE_S` seconds."""
    deadline = None if timeout is None else monotonic() + timeout
    while True:
        left = SLICE_S if deadline is None else min(SLICE_S, max(0.0, deadline - monotonic()))
        if await self.socket.poll(int(left * 1000)):
            return await self._recv()
        if deadline is not None and monotonic() >= deadline:
            raise Empty


def install() -> None:
    """Make every asynchronous kernel client in this process wait in slices (idempotent)."""
    AsyncZMQSocketChannel.get_msg = get_msg
