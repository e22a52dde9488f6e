"""What each test file and notebook of the suite costs when it runs alone: wall seconds, and the
CPU-seconds the whole machine spent meanwhile (its ranks, kernels and launchers included).

    python tools/file_costs.py tests/test_kernel.py build/notebooks/A6_your_own_loop.ipynb
    make costs                                  # every file of `make test`, about 30 minutes

The suite is mostly process start-up on shared cores, so its wall time follows its CPU-seconds:
this table says which claims the time goes to. Run it on an idle machine (the CPU figure counts
every process), with the `make bench` figure beside it. Under `make test` the files share a
pytest start per worker and a session of ranks, so there each costs a few CPU-seconds less.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def busy_seconds(stat: str | None = None) -> float:
    """CPU-seconds every core of the machine has spent not idle since boot (/proc/stat)."""
    if stat is None:
        stat = Path("/proc/stat").read_text()
    fields = [int(v) for v in stat.splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is inside user


def passed(summary: str) -> int:
    """The passed count of pytest's summary line ("3 passed, 1 skipped in 2.10s" -> 3)."""
    found = re.search(r"(\d+) passed", summary)
    return int(found.group(1)) if found else 0


def cost(target: str, python: str = sys.executable) -> dict:
    """Run one test file (or notebook, under nbmake) alone; its wall, CPU, result, summary."""
    args = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", target]
    env = dict(os.environ)
    if target.endswith(".ipynb"):
        args += ["--nbmake", "--nbmake-timeout=600", "--overwrite"]
    if Path(target).name == "test_docs_site.py":
        env["GAS_LAB_BUILD_SITE"] = "1"  # build and open the site, as `make test` does
    cpu, wall = busy_seconds(), time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    cpu, wall = busy_seconds() - cpu, time.monotonic() - wall
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else proc.stderr.strip()[-200:]
    return {"target": target, "wall": round(wall, 1), "cpu": round(cpu, 1),
            "exit": proc.returncode, "passed": passed(summary), "summary": summary}  # fmt: skip


def table(rows: list[dict]) -> str:
    """The rows by CPU-seconds, most first, and their totals."""
    out = [f"{'CPU-s':>7} {'wall s':>7} {'passed':>6}  file"]
    for r in sorted(rows, key=lambda r: -r["cpu"]):
        failed = "" if r["exit"] == 0 else f"   FAILED (exit {r['exit']}): {r['summary']}"
        out.append(f"{r['cpu']:7.1f} {r['wall']:7.1f} {r['passed']:6d}  {r['target']}{failed}")
    total = (sum(r["cpu"] for r in rows), sum(r["wall"] for r in rows))
    out.append(f"{total[0]:7.1f} {total[1]:7.1f} {sum(r['passed'] for r in rows):6d}  in all")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", help="test files and notebooks, in this order")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for target in args.targets:
        rows.append(cost(target))
        r = rows[-1]
        print(f"{r['cpu']:7.1f} CPU-s {r['wall']:7.1f} s  {target}: {r['summary']}", flush=True)
    print("\n" + table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
