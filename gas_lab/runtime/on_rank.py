"""What runs inside each rank process of the notebook runtime (see :mod:`gas_lab.runtime.cluster`).

These functions are sent to the ranks, so they import what they need themselves.
"""

from __future__ import annotations


def setup_rank(rank: int, store_path: str, pg_timeout_s: float, tmp: str, cluster_id: str) -> dict:
    """Runs on each notebook rank once: set the torchrun-style variables, join the group, and
    prepare what the notebook needs to watch the rank (see the helpers below)."""
    import os

    import torch.distributed as dist

    from gas_lab.dp import init_from_env

    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    _watch_stack_and_crash(os.path.join(tmp, f"stack-{rank}.txt"), tmp, rank)
    _end_with_owner(cluster_id)
    _text_progress_bars()
    _quiet_renamed_collectives()
    # A file store (not a TCP store) so that nothing listens beyond gloo's loopback pairs.
    init_from_env(f"file://{store_path}", pg_timeout_s)
    return {
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "backend": dist.get_backend(),
    }


_kept_open: list = []  # files faulthandler writes to must stay open for the process's life


def _watch_stack_and_crash(stack_path: str, tmp: str, rank: int) -> None:
    """SIGUSR2 appends the interrupted thread's stack to ``stack_path`` (even while blocked in
    C++, so the notebook can tell a rank waiting in a collective from a busy one; the notebook
    signals the main thread), and a crash (SIGSEGV, ...) writes where it happened to
    ``crash-<rank>.txt``, which the notebook shows. One thread only: a dump of every thread
    reads the others' frames as they change, and can crash the rank (rank_state)."""
    import faulthandler
    import os
    import signal

    stack = open(stack_path, "a")
    crash = open(os.path.join(tmp, f"crash-{rank}.txt"), "w")
    _kept_open.extend([stack, crash])
    if hasattr(signal, "SIGUSR2"):  # POSIX only
        faulthandler.register(signal.SIGUSR2, file=stack, all_threads=False, chain=False)
    faulthandler.enable(file=crash, all_threads=False)


def _end_with_owner(cluster_id: str) -> None:
    """A thread that ends this rank (and what it started) once the notebook kernel is gone, in
    case the guardian process that normally does it was killed too."""
    import os
    import signal
    import threading
    import time

    import psutil

    from gas_lab.runtime.lifetime import end_processes, owner_alive

    def watch():
        while owner_alive(cluster_id):
            time.sleep(1.0)
        end_processes(psutil.Process().children(recursive=True))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="gas_lab-owner-watch", daemon=True).start()


def _text_progress_bars() -> None:
    """Make ``tqdm.auto`` draw text bars on the ranks. A rank runs inside an IPython kernel, so
    ``tqdm.auto`` would pick its notebook widget, which cannot travel to the notebook; the text
    bar travels as output and the notebook shows it as one live line."""
    import sys

    hidden = sys.modules.pop("ipykernel.zmqshell", None)  # what tqdm.auto looks for
    try:
        import tqdm.auto  # noqa: F401 (decides its mode once, now)
    except ImportError:
        pass
    finally:
        if hidden is not None:
            sys.modules["ipykernel.zmqshell"] = hidden


def _quiet_renamed_collectives() -> None:
    """torch 2.13 renamed two collectives; DeepSpeed 0.19.8 calls them by their old names, and
    each call would print a FutureWarning above the lesson's output that is no fault of it."""
    import warnings

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings(
            "ignore", f"`torch.distributed.{name}` is deprecated", FutureWarning
        )


def sequence_number() -> int:
    """How many collectives this rank has issued on the default process group. Equal on every
    rank when the group is in step; unequal after an interrupt caught the ranks at different
    collectives, and then the group cannot be trusted."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()


def remember_source(filename: str, lines: list[str], first_line: int = 1) -> None:
    """Let tracebacks on a rank show the source of code that only exists in the notebook."""
    import linecache

    padded = [""] * (first_line - 1) + lines
    linecache.cache[filename] = (sum(map(len, padded)), None, padded, filename)


def call_on_rank(fn, args, kwargs, source=None):
    """Runs on a rank: call ``fn``; return ``("ok", pickled result)`` or ``("error", text)``.

    Returning the error as a value (instead of letting ipyparallel wrap it) keeps the
    traceback short and uncoloured: only the rank's own frames, as Python prints them. The
    result is pickled here so that one that cannot be sent (a generator, a socket) is reported
    as such, not as a traceback from inside ipyparallel's serializer.
    """
    import traceback

    import cloudpickle

    code = getattr(fn, "__code__", None)
    if source and code is not None:
        remember_source(code.co_filename, *source)
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
        text = "".join(traceback.format_list(frames))
        return (
            "error",
            "Traceback (most recent call last):\n"
            + text
            + "".join(traceback.format_exception_only(exc)),
        )
    try:
        return ("ok", cloudpickle.dumps(result))
    except Exception as exc:
        name = getattr(fn, "__qualname__", None) or repr(fn)
        return (
            "unsendable",
            f"the return value of {name} (a {type(result).__name__}) cannot be sent back to the "
            f"notebook: {type(exc).__name__}: {exc}. Return plain data (numbers, strings, lists, "
            "dicts, tensors) instead.",
        )


def exec_on_rank(code: str, name: str):
    """Runs on a rank: execute a ``%%ranks`` cell in the rank's persistent namespace. As in
    IPython, a last line that is an expression is the cell's value, unless a ``;`` ends the
    cell: returned as the rank's mime bundle ``(data, metadata)`` (None when there is none)."""
    import ast

    from IPython import get_ipython

    ip = get_ipython()
    remember_source(name, code.splitlines(keepends=True))
    tree = ast.parse(code, name)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, name, "exec"), ip.user_ns)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), name, "eval"), ip.user_ns)
    if value is None or _ends_with_semicolon(code):
        return None
    ip.user_ns["_"] = value  # as IPython keeps the last value
    data, metadata = ip.display_formatter.format(value)
    # A widget lives in this rank's kernel; the notebook could not draw it.
    data.pop("application/vnd.jupyter.widget-view+json", None)
    return data, metadata


def _ends_with_semicolon(code: str) -> bool:
    """IPython's rule: a ``;`` as the cell's last token silences its value."""
    from IPython.core.displayhook import DisplayHook

    return DisplayHook.semicolon_at_end_of_expression(code)
