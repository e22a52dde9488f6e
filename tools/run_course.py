"""Execute every notebook headless, lessons then appendices, and print seconds per notebook.

The executed copies are saved in the output folder.

    python tools/run_course.py tutorials build        # what `make course` runs

Instructors run this on a workshop machine the day before: it proves the machine can run the
whole course and says how long each lesson's cells take there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import kernel_replies  # tools/: a reply is read within a second, not at the cell timeout
import nbformat
import zmq
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets.config import Config

# The kernel's channels encrypted (CurveZMQ, where the kernel supports it), as they should be:
# the kernel then also has no "running over TCP without encryption" warning to print once per
# notebook into the table.
KERNELS = Config(KernelManager={"transport_encryption": "auto" if zmq.has("curve") else "disabled"})


def run_notebook(path: Path, out_dir: Path, timeout: int) -> tuple[float, str]:
    """Execute one notebook in its own folder (so relative paths work); return (seconds, status)."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        config=KERNELS,
    )
    t0 = time.perf_counter()
    status = "ok"
    try:
        client.execute()
    except CellExecutionError as err:
        status = "FAILED: " + str(err).strip().splitlines()[-1][:120]
    seconds = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / path.name)
    return seconds, status


def main(argv: list[str] | None = None) -> int:
    kernel_replies.install()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", type=Path, help="a folder of .ipynb files, or one notebook")
    parser.add_argument("out", type=Path, help="folder for the executed copies")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    paths = (
        [args.notebooks]
        if args.notebooks.suffix == ".ipynb"
        else sorted(args.notebooks.glob("[0-9][0-9]_*.ipynb"))
        + sorted(args.notebooks.glob("A[0-9]_*.ipynb"))  # the appendices, after the lessons
    )
    rows = []
    for path in paths:
        print(f"running {path.name} ...", flush=True)
        rows.append((path.name, *run_notebook(path, args.out, args.timeout)))
    width = max(len(name) for name, *_ in rows)
    print(f"\n{'notebook':<{width}}  seconds  status")
    for name, seconds, status in rows:
        print(f"{name:<{width}}  {seconds:7.1f}  {status}")
    for label, first in (("lessons", "0123456789"), ("appendices", "A")):
        part = [s for name, s, _ in rows if name[0] in first]
        if part and len(part) < len(rows):
            print(f"{label:<{width}}  {sum(part):7.1f}")
    print(f"{'total':<{width}}  {sum(s for _, s, _ in rows):7.1f}")
    return 0 if all(status == "ok" for *_, status in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
