"""tools/bench_step_time.py: a smoke run of a few steps on the session's ranks (the timing itself
is `make bench`, never a test: timings on a shared machine are noise)."""

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench_module():
    spec = importlib.util.spec_from_file_location(
        "bench_step_time", ROOT / "tools" / "bench_step_time.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _smoke(bench, args):
    result = bench.bench(args)
    return result, bench.report(result, args)


@pytest.mark.ranks
def test_bench_reports_three_timings_of_the_same_loop(cluster):
    bench = _bench_module()
    args = argparse.Namespace(
        steps=2, rounds=2, warmup=1, gas=3, micro=4, d_in=8, hidden=8, layers=2
    )
    (result, text), *_ = cluster.run(_smoke, bench, args, timeout=300)
    ms = result["ms_per_step"]
    assert set(ms) == {"gas_lab", "deepspeed", "ddp"} and all(v > 0 for v in ms.values())
    # The same loop really ran on all three: same parameters at the end.
    assert result["max_param_diff"] < 1e-5
    lines = text.splitlines()
    assert lines[0].startswith("2 ranks (gloo)")
    for lib in ("gas_lab", "deepspeed", "ddp"):
        assert sum(ln.startswith(lib) and "ms per optimizer step" in ln for ln in lines) == 1, lib
    assert any(ln.startswith("ratios") and "gas_lab/ddp" in ln for ln in lines)
