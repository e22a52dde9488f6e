"""What the learner passes to the runtime, checked before anything starts: a mistake is one
line naming the argument and what it must be, not a traceback from deep inside (lesson 00)."""

from __future__ import annotations

import math
import numbers
import shlex

try:
    from IPython.core.error import UsageError  # shown by IPython as one line, no traceback
except ImportError:  # pragma: no cover (IPython comes with JupyterLab)

    class UsageError(ValueError):
        pass


def check_world_size(world_size) -> int | None:
    """None (automatic) or a whole number of ranks, at least 1; anything else, a one-line error."""
    if world_size is None:
        return None
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise TypeError(
            f"start_cluster(world_size={world_size!r}): world_size must be a whole number of "
            "ranks, such as 2, or None for the default"
        )
    if world_size < 1:
        raise ValueError(f"start_cluster(world_size={world_size}): world_size must be at least 1")
    return int(world_size)


def check_seconds(value, name: str = "timeout") -> float:
    """A timeout is a positive number of seconds; anything else gets a one-line error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r}: the timeout must be a number of seconds, such as 60")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: the timeout must be more than 0 seconds")
    return float(value)


USAGE = "%%ranks [--timeout SECONDS] [--rank N[,N...]]"


def parse_ranks_line(line: str, default_timeout: float) -> tuple[float, list[int] | None]:
    """The timeout a ``%%ranks`` line asks for (``default_timeout`` when it names none), and the
    ranks it runs on (``--rank 0`` or ``--rank 0,1``; None: every rank)."""
    try:
        parts = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"%%ranks {line}: {exc}; use {USAGE}") from None
    timeout, ranks, i = default_timeout, None, 0
    while i < len(parts):
        option = parts[i]
        name, _, value = option.partition("=")
        if name not in ("--timeout", "--rank"):
            raise UsageError(f"%%ranks: unknown option {option!r}; use {USAGE}")
        if not value:
            if i + 1 >= len(parts):
                example = "--timeout 300" if name == "--timeout" else "--rank 0"
                what = "a number of seconds" if name == "--timeout" else "rank numbers"
                raise UsageError(f"%%ranks {name} needs {what}: %%ranks {example}")
            value, i = parts[i + 1], i + 2
        else:
            i += 1
        if name == "--rank":
            ranks = _ranks(value)
        else:
            timeout = _timeout(value)
    return timeout, ranks


def _ranks(value: str) -> list[int]:
    try:
        ranks = sorted({int(r) for r in value.split(",")})
    except ValueError:
        raise UsageError(
            f"%%ranks --rank {value}: not rank numbers; e.g. %%ranks --rank 0 or --rank 0,1"
        ) from None
    if ranks[0] < 0:
        raise UsageError(f"%%ranks --rank {value}: ranks are numbered from 0")
    return ranks


def _timeout(value: str) -> float:
    try:
        timeout = float(value)
    except ValueError:
        raise UsageError(
            f"%%ranks --timeout {value}: not a number of seconds; e.g. %%ranks --timeout 300"
        ) from None
    if not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"%%ranks --timeout {value}: the timeout must be more than 0 seconds")
    return timeout


def default_world_size() -> tuple[int, str]:
    """One rank per GPU with nccl where GPUs exist, else 2 CPU ranks with gloo."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count(), "nccl"
    except ImportError:
        pass
    return 2, "gloo"
