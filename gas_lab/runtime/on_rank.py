"""What runs inside each rank process of the notebook runtime (see :mod:`gas_lab.runtime.cluster`).

These functions are sent to the ranks, so they import what they need themselves.
"""

from __future__ import annotations


def setup_rank(rank: int, store_path: str, pg_timeout_s: float) -> dict:
    """Runs on each notebook rank once: set the torchrun-style variables, join the group."""
    import os

    import torch.distributed as dist

    from gas_lab.dp import init_from_env

    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    # A file store (not a TCP store) so that nothing listens beyond gloo's loopback pairs.
    init_from_env(f"file://{store_path}", pg_timeout_s)
    return {"rank": dist.get_rank(), "pid": os.getpid(), "backend": dist.get_backend()}


def _remember_source(filename: str, lines: list[str], first_line: int = 1) -> None:
    """Let tracebacks on a rank show the source of code that only exists in the notebook."""
    import linecache

    padded = [""] * (first_line - 1) + lines
    linecache.cache[filename] = (sum(map(len, padded)), None, padded, filename)


def call_on_rank(fn, args, kwargs, source=None):
    """Runs on a rank: call ``fn`` and turn an exception into plain traceback text.

    Returning the error as a value (instead of letting ipyparallel wrap it) keeps the
    traceback short and uncoloured: only the rank's own frames, as Python prints them.
    """
    import traceback

    code = getattr(fn, "__code__", None)
    if source and code is not None:
        _remember_source(code.co_filename, *source)
    try:
        return ("ok", fn(*args, **kwargs))
    except BaseException as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
        text = "".join(traceback.format_list(frames))
        return (
            "error",
            "Traceback (most recent call last):\n"
            + text
            + "".join(traceback.format_exception_only(exc)),
        )


def exec_on_rank(code: str):
    """Runs on a rank: execute a ``%%ranks`` cell in the rank's persistent namespace."""
    from IPython import get_ipython

    name = f"<%%ranks cell {abs(hash(code))}>"
    _remember_source(name, code.splitlines(keepends=True))
    exec(compile(code, name, "exec"), get_ipython().user_ns)
