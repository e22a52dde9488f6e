"""A rank with nothing to train on: what DeepSpeed 0.19.8 and gas_lab do, per ZeRO stage.

An RL or RPC-driven trainer can end up with a step in which one rank received no data. Two
schedules (micro-batches per rank at each of three steps) and two loops:

* schedule ``idle``: at step 1 rank 0 has nothing and rank 1 has two micro-batches;
  ``all_idle``: at step 1 no rank has anything.
* loop ``raw``: a rank runs the micro-batches it has. Every rank joins the count (the global
  number of micro-batches, the divisor of every loss; one collective) and then calls
  ``step()`` (managed: GAS ``step()`` calls, one per micro-step, with or without a backward).
* loop ``workaround``: every rank pads the step to the largest count of any rank (managed: to
  GAS) with dummy micro-batches (:func:`dummy_micro_batch`), whose loss is multiplied by 0
  and which count no samples; when no rank has data, every rank skips the step.
  :func:`padded_step` is that loop, after :func:`step_counts` (one all-gather).

Every run is checked against :func:`gas_lab.measure.parity.reference_params` (one process,
all real micro-batches of a step in one mean, no update for a step without data).

``python -m gas_lab.measure.idle_rank`` measures every case, each in two fresh processes (a
case can crash a rank, abort it from inside gloo or leave it waiting in a collective, so each
is bounded), and writes ``data/deepspeed_<version>_idle_rank.json``; lesson 07 shows it and
``tests/test_idle_rank.py`` re-runs the cases that finish.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gas_lab.toys import flat_params, micro_batch, tiny_model

SCHEDULES = {"idle": ((2, 2), (0, 2), (2, 2)), "all_idle": ((2, 2), (0, 0), (2, 2))}
LOOPS = ("raw", "workaround")
GAS, MICRO, TOL = 2, 2, 1e-6
HANG_S = 60  # a rank still running after this dumps its stack and exits
DATA = Path(__file__).resolve().parents[2] / "data"


def config(stage: int, managed: bool, clip: float) -> dict:
    """The config of every case: Adam from torch, GAS 2 (managed only), ``clip`` explicit."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "managed_gradient_accumulation": managed,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
    }


def count(schedule: str, step: int, rank: int) -> int:
    """Micro-batches of ``rank`` at ``step``: rank 0 is the one that may be idle, every other
    rank has what rank 1 has (so the cases run on any number of ranks)."""
    return SCHEDULES[schedule][step][min(rank, 1)]


def dummy_micro_batch(device="cpu", size: int = MICRO, d_in: int = 4, d_out: int = 2):
    """A micro-batch for a rank without data: zeros, so its loss is finite and its gradient,
    once the loss is multiplied by 0, exactly zero."""
    return torch.zeros(size, d_in, device=device), torch.zeros(size, d_out, device=device)


def step_counts(n: int, group=None) -> tuple[int, int]:
    """This step's micro-batches on all ranks together, and the most on any one rank: one
    all-gather of one number per rank, which every rank joins, with data or without."""
    on_gpu = dist.get_backend(group) == "nccl"  # nccl only moves GPU tensors
    mine = torch.tensor([n], device=f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu")
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return sum(int(t) for t in every), max(int(t) for t in every)


def padded_step(engine, batches: list, n_max: int, n_global: int) -> None:
    """One unmanaged step of the workaround, on one rank.

    ``batches``: this rank's micro-batches (maybe none); ``n_max``: the most any rank has;
    ``n_global``: all ranks' micro-batches (> 0; the caller skips the step when it is 0).
    Each real loss is divided by n_global / W, so that after the ranks' gradients are
    averaged every micro-batch weighs the same; the dummies fill up to n_max with loss x 0.
    """
    scale, device = dist.get_world_size() / n_global, next(engine.parameters()).device
    for i in range(n_max):
        x, y = batches[i] if i < len(batches) else dummy_micro_batch(device)
        weight = scale if i < len(batches) else 0.0  # a dummy trains nothing and counts nothing
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss * weight, scale_wrt_gas=False)
    engine.step()


def run(lib: str, stage: int, managed: bool, clip: float, schedule: str, loop: str) -> dict:
    """On a rank: train one case; returns the parameters and the counters after each step."""
    from gas_lab.measure.parity import initializer

    model = tiny_model(0)
    engine, *_ = initializer(lib)(
        model=model, model_parameters=model.parameters(), config=config(stage, managed, clip)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(engine.parameters()).device
    counters = []
    for step in range(len(SCHEDULES[schedule])):
        batches = [
            tuple(t.to(device) for t in micro_batch(0, step, m, rank, MICRO))
            for m in range(count(schedule, step, rank))
        ]
        n_global, n_max = step_counts(len(batches))
        if loop == "workaround" and n_global == 0:
            continue  # nobody has data: no rank steps
        if loop == "workaround" and not managed:
            padded_step(engine, batches, n_max, n_global)
        else:
            # managed: GAS micro-steps, real ones first, then dummies (workaround) or a bare
            # step() (raw); unmanaged raw: the real micro-batches, then one step()
            for i in range(GAS if managed else len(batches)):
                if i < len(batches) or loop == "workaround":
                    x, y = batches[i] if i < len(batches) else dummy_micro_batch(device)
                    weight = world / n_global if i < len(batches) else 0.0
                    loss = torch.nn.functional.mse_loss(engine(x), y) * weight
                    engine.backward(loss, scale_wrt_gas=False)
                if managed:
                    engine.step()
            if not managed:
                engine.step()
        counters.append((engine.global_steps, engine.global_samples, engine.micro_steps))
    if stage == 3:  # ZeRO-3 partitions the weights themselves: gather them to compare
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {"params": flat_params(engine.module).tolist(), "counters": counters}
    return {"params": flat_params(engine.module).tolist(), "counters": counters}


def reference(managed: bool, clip: float, schedule: str, world_size: int = 2) -> torch.Tensor:
    """The parameters a correct loop ends with, at any ZeRO stage: one process, every real
    micro-batch of a step in one mean, no update for a step without data."""
    from gas_lab.measure.parity import reference_params

    return reference_params(
        config(0, managed, clip), len(SCHEDULES[schedule]), lambda s, r: count(schedule, s, r),
        world_size=world_size, clip=clip, skip_empty=True,
    )  # fmt: skip


def cases(libs=("deepspeed", "gas_lab")) -> list[dict]:
    """Every case: library x ZeRO stage (gas_lab: the ones it has) x managed x clipping x
    schedule x loop."""
    from gas_lab.deepspeed_compat.strategies import strategy_for

    out = []
    for lib in libs:
        for stage in range(4):
            try:
                strategy_for(stage) if lib == "gas_lab" else None
            except ValueError:
                continue  # a stage gas_lab does not implement
            for managed in (False, True):
                for clip in (0.0, 1.0):
                    for schedule in SCHEDULES:
                        for loop in LOOPS:
                            out.append({"lib": lib, "stage": stage, "managed": managed,
                                        "clip": clip, "schedule": schedule, "loop": loop})  # fmt: skip
    return out


# ---------------------------------------------------------------- one case in fresh processes
def _rank_main(case: dict, out: str) -> None:
    """Entry point of one rank process (``RANK``, ``WORLD_SIZE``... set by :func:`measure`)."""
    import faulthandler
    import traceback

    from gas_lab.dp import init_from_env

    faulthandler.dump_traceback_later(HANG_S, exit=True)
    init_from_env(timeout_s=HANG_S / 2)  # a collective nobody joins fails, bounded
    path = Path(out) / f"rank{dist.get_rank()}.json"
    try:
        result = run(**case)
        ref = reference(case["managed"], case["clip"], case["schedule"])
        diff = (torch.tensor(result["params"]) - ref).abs().max().item()
        path.write_text(json.dumps({"outcome": "ok" if diff <= TOL else "wrong", "diff": diff,
                                    "counters": result["counters"]}))  # fmt: skip
    except Exception as err:  # the point: record what each rank raised, and where
        frames = [f"{_short(f.filename)}:{f.lineno} {f.name}"
                  for f in traceback.extract_tb(err.__traceback__)]  # fmt: skip
        where = [f for f in frames if not f.startswith("torch/")][-2:]
        timed_out = "timed out" in str(err).lower()  # waited HANG_S / 2 in a collective
        path.write_text(json.dumps({"outcome": "hang" if timed_out else "raised",
                                    "exception": type(err).__name__,
                                    "refused_as": getattr(getattr(err, "rule", None),
                                                          "deepspeed_raises", None),
                                    "message": str(err).splitlines()[0][:200] if str(err) else "",
                                    "where": where}))  # fmt: skip
        sys.exit(1)


def _short(filename: str) -> str:
    """``deepspeed/runtime/engine.py``, ``gas_lab/engine.py``: a path without the machine's."""
    short = re.sub(r"^.*(?:site-packages/|/(?=gas_lab/))", "", filename)
    return short if short != filename else os.path.basename(filename)


def _from_log(log: str) -> dict:
    """A rank that wrote no result: aborted inside C++ (gloo checks message sizes) or stopped
    by faulthandler while waiting (a hang)."""
    if "Timeout (" in log:
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\w+)', log.split("Timeout (", 1)[1])
        inside = [f"{_short(p)}:{n} {fn}" for p, n, fn in frames if "distributed" not in p]
        return {"outcome": "hang", "where": inside[:2]}
    what = re.search(r"what\(\):\s*(.*)", log)
    if "terminate called" in log or "Aborted" in log:
        return {"outcome": "abort", "message": (what.group(1) if what else "")[:200]}
    return {"outcome": "no result", "message": log.strip().splitlines()[-1][:200] if log else ""}


def measure_case(case: dict, world_size: int = 2, timeout: float = HANG_S + 30) -> dict:
    """Run ``case`` in ``world_size`` fresh processes; what each rank did, and the seconds."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        procs, logs = [], []
        start = time.perf_counter()
        for rank in range(world_size):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # fmt: skip
            log = open(Path(out) / f"log{rank}.txt", "w")  # noqa: SIM115 (closed below)
            code = "import json, sys; from gas_lab.measure.idle_rank import _rank_main; " \
                   "_rank_main(json.loads(sys.argv[1]), sys.argv[2])"  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, "-c", code, json.dumps(case), out],
                                          env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
            logs.append(log)
        deadline = start + timeout
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.perf_counter(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        seconds = time.perf_counter() - start
        ranks = []
        for rank, log in enumerate(logs):
            log.close()
            result = Path(out) / f"rank{rank}.json"
            text = (Path(out) / f"log{rank}.txt").read_text(errors="replace")
            ranks.append(json.loads(result.read_text()) if result.exists() else _from_log(text))
    return {**case, "ranks": ranks, "seconds": round(seconds, 1)}


def summary(ranks: list[dict]) -> str:
    """One cell of lesson 07's table: what the ranks did, in a few words."""
    kinds = [r["outcome"] for r in ranks]
    if all(k == "ok" for k in kinds):
        return "trains right"
    if all(k in ("ok", "wrong") for k in kinds):
        return f"trains wrong ({max(r['diff'] for r in ranks):.0e} off), no error"
    return "; ".join(f"rank {i}: {_said(r)}" for i, r in enumerate(ranks))


def _said(rank: dict) -> str:
    if rank["outcome"] == "raised" and rank.get("refused_as"):
        return f"refused ({rank['refused_as']})"
    if rank["outcome"] == "raised" and "by peer" in rank["message"]:  # gloo: the peer died
        return f"{rank['exception']}, its peer is gone"
    if rank["outcome"] == "raised":
        return rank["exception"]
    return {"abort": "aborted by gloo (message sizes differ)", "hang": "waits, timed out"}.get(
        rank["outcome"], rank["outcome"]
    )


def main(libs: tuple[str, ...] = ("deepspeed", "gas_lab"), out: Path | None = None) -> Path:
    """Measure the cases of ``libs`` and write the file; cases of other libraries already in
    it are kept (``python -m gas_lab.measure.idle_rank gas_lab`` re-measures gas_lab only)."""
    import deepspeed

    out = out or DATA / f"deepspeed_{deepspeed.__version__}_idle_rank.json"
    kept = json.loads(out.read_text())["cases"] if out.exists() else []
    results = [c for c in kept if c["lib"] not in libs]
    for case in cases(libs):
        results.append(measure_case(case))
        print(case, "->", [r["outcome"] for r in results[-1]["ranks"]], flush=True)
    order = {lib: i for i, lib in enumerate(("deepspeed", "gas_lab"))}
    results.sort(key=lambda c: order[c["lib"]])  # stable: each library's cases in their order
    doc = {
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "setup": "2 CPU processes, gloo, DS_ACCELERATOR=cpu; each case in fresh processes, "
        f"a rank stopped after {HANG_S} s",
        "measured_by": "python -m gas_lab.measure.idle_rank",
        "schedules": {k: [list(c) for c in v] for k, v in SCHEDULES.items()},
        "cases": results,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return out


if __name__ == "__main__":
    print(main(tuple(sys.argv[1:]) or ("deepspeed", "gas_lab")))
