"""A rank with fewer micro-batches than the others, none included: the rule, per ZeRO stage and
mode, and its measurement on DeepSpeed 0.19.8 and gas_lab.

**The rule** (appendix A3, ``tutorials/A3_idle_ranks.ipynb``, is the one place the course states
it; :func:`backward_calls` is the rule as code):

Every rank joins every collective of a step. So a rank owes each step the ``backward()`` calls
that hold its stage's collectives::

    | | stage 0 | stage 1 | stages 2 and 3 |
    |---|---|---|---|
    | **unmanaged** | any number, none included | at least one | the busiest rank's count |
    | **managed** | one per micro-step, ``gradient_accumulation_steps`` in all | the same | the same |

Managed, at stages 0 and 1 only the boundary micro-step's call reduces; at stages 2 and 3 every
one does. A rank with fewer micro-batches makes up the difference with zero-weight
micro-batches; when no rank has data, no rank calls ``backward()`` or ``step()``.

Three schedules (micro-batches of (rank 0, rank 1) at each of three steps) and two loops:

* ``idle``: at step 1 rank 0 has nothing; ``ragged``: at step 1 rank 0 has fewer;
  ``all_idle``: at step 1 no rank has anything.
* loop ``raw``: a rank runs the micro-batches it has, nothing more (managed: its real ones,
  then bare ``step()`` calls up to GAS micro-steps), and every rank calls ``step()``.
* loop ``rule``: :func:`padded_step` with :func:`backward_calls` dummies included; a step in
  which no rank has data is skipped by every rank.

Every rank joins the step's count first (:func:`step_counts`, one all-gather). Every run is
checked against :func:`gas_lab.measure.parity.reference_params` (one process, all real
micro-batches of a step in one mean, no update for a step without data).

``python -m gas_lab.measure.idle_rank`` measures every case, each in fresh processes (a
case can crash a rank, abort it from inside gloo or leave it waiting in a collective, so each
is bounded), and writes ``data/deepspeed_<version>_idle_rank.json``; ``tests/test_idle_rank.py``
holds the rule to it, and appendix A3 re-measures cases live.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from gas_lab.toys import flat_params, micro_batch, tiny_model

SCHEDULES = {
    "idle": ((2, 2), (0, 2), (2, 2)),
    "ragged": ((2, 2), (1, 2), (2, 2)),
    "all_idle": ((2, 2), (0, 0), (2, 2)),
}
LOOPS = ("raw", "rule")
GAS, MICRO, TOL = 2, 2, 1e-6
HANG_S = 60  # a rank still running after this dumps its stack and exits
DATA = Path(__file__).resolve().parents[2] / "data"


def backward_calls(stage: int, managed: bool, n: int, n_max: int, gas: int) -> int:
    """The rule: how many ``backward()`` calls a rank with ``n`` micro-batches makes in a step
    whose busiest rank has ``n_max`` (> 0; with 0 every rank skips the step)."""
    if managed:
        return gas  # the engine counts micro-steps: every rank runs the window's GAS
    if stage >= 2:
        return n_max  # every backward() reduces: the k-th call of one rank meets the k-th of all
    if stage == 1:
        return max(n, 1)  # ZeRO-1's step() reduces what this rank's backward() calls produced
    return n  # stage 0: step() all-reduces .grad, zeros for a rank that ran none


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
    """Micro-batches of ``rank`` at ``step``: rank 0 is the one with fewer, every other rank
    has what rank 1 has (so the cases run on any number of ranks)."""
    return SCHEDULES[schedule][step][min(rank, 1)]


def rule_pads(stage: int, managed: bool, schedule: str, world_size: int = 2) -> bool:
    """Whether the rule asks anything of this schedule beyond the raw loop: a dummy on some
    rank, or a step skipped because no rank has data."""
    for step in range(len(SCHEDULES[schedule])):
        ns = [count(schedule, step, r) for r in range(world_size)]
        if max(ns) == 0 or any(backward_calls(stage, managed, n, max(ns), GAS) != n for n in ns):
            return True
    return False


def dummy_micro_batch(device="cpu", size: int = MICRO, d_in: int = 4, d_out: int = 2):
    """A micro-batch for padding: zeros, so its loss is finite and its gradient, once the loss
    is multiplied by 0, exactly zero."""
    return torch.zeros(size, d_in, device=device), torch.zeros(size, d_out, device=device)


def step_counts(n: int, group=None) -> tuple[int, int]:
    """This step's micro-batches on all ranks together, and the most on any one rank: one
    all-gather of one number per rank, which every rank joins, with data or without. (A SUM
    all-reduce gives the total only; the busiest rank's count needs the gather, or a MAX.)"""
    on_gpu = dist.get_backend(group) == "nccl"  # nccl only moves GPU tensors
    mine = torch.tensor([n], device=f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu")
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return sum(int(t) for t in every), max(int(t) for t in every)


def padded_step(engine, batches: list, calls: int, n_global: int, managed: bool = False) -> None:
    """One optimizer step on one rank: its real micro-batches, then dummies, ``calls``
    backward() calls in all (:func:`backward_calls`).

    ``n_global``: the real micro-batches of every rank (> 0). The toy's loss is a mean over a
    micro-batch of fixed size, so each real loss weighs ``W / n_global``: once the ranks'
    gradients are averaged every real micro-batch weighs the same. A dummy weighs 0.
    """
    world, device = dist.get_world_size(), next(engine.parameters()).device
    for i in range(calls):
        real = i < len(batches)
        x, y = batches[i] if real else dummy_micro_batch(device)
        loss = torch.nn.functional.mse_loss(engine(x), y) * (world / n_global if real else 0.0)
        engine.backward(loss, scale_wrt_gas=False)
        if managed:
            engine.step()  # the GAS-th one updates
    if not managed:
        engine.step()


def _raw_step(engine, batches: list, n_global: int, managed: bool) -> None:
    """The loop without the rule: real micro-batches only (managed: bare step() calls up to
    GAS micro-steps), and step() whatever the other ranks have."""
    world = dist.get_world_size()
    for i in range(GAS if managed else len(batches)):
        if i < len(batches):
            loss = torch.nn.functional.mse_loss(engine(batches[i][0]), batches[i][1])
            engine.backward(loss * world / n_global, scale_wrt_gas=False)
        if managed:
            engine.step()
    if not managed:
        engine.step()


def run(lib: str, stage: int, managed: bool, clip: float, schedule: str, loop: str) -> dict:
    """On a rank: train one case; returns the parameters and, after each step, the counters
    (global_steps, global_samples, micro_steps) and this rank's backward() calls."""
    from gas_lab.measure.parity import initializer, quiet_deepspeed

    if loop not in LOOPS:
        raise ValueError(f"loop {loop!r}: choose from {LOOPS}")
    model = tiny_model(0)
    engine, *_ = initializer(lib)(
        model=model, model_parameters=model.parameters(), config=config(stage, managed, clip)
    )
    rank, device = dist.get_rank(), next(engine.parameters()).device
    counters = []
    with quiet_deepspeed():
        for step in range(len(SCHEDULES[schedule])):
            batches = [
                tuple(t.to(device) for t in micro_batch(0, step, m, rank, MICRO))
                for m in range(count(schedule, step, rank))
            ]
            n_global, n_max = step_counts(len(batches))
            if loop == "raw":
                _raw_step(engine, batches, n_global, managed)
                calls = len(batches)
            elif n_max == 0:
                calls = 0  # nobody has data: no rank steps
            else:
                calls = backward_calls(stage, managed, len(batches), n_max, GAS)
                padded_step(engine, batches, calls, n_global, managed)
            counters.append((engine.global_steps, engine.global_samples, engine.micro_steps, calls))
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


def diff_to_reference(case: dict, world_size: int = 2) -> float:
    """On a rank: run ``case`` (the keys of :func:`run`) and return its largest parameter
    difference from :func:`reference`."""
    got = run(**case)
    ref = reference(case["managed"], case["clip"], case["schedule"], world_size)
    return (torch.tensor(got["params"]) - ref).abs().max().item()


def cases(libs=("deepspeed", "gas_lab")) -> list[dict]:
    """Every case: library x ZeRO stage (gas_lab: the ones it has) x managed x schedule x
    loop x clipping (1.0, DeepSpeed's default; the raw loop also without clipping)."""
    from gas_lab.deepspeed_compat.strategies import strategy_for

    out = []
    for lib in libs:
        for stage in range(4):
            try:
                strategy_for(stage) if lib == "gas_lab" else None
            except ValueError:
                continue  # a stage gas_lab does not implement
            for managed in (False, True):
                for schedule in SCHEDULES:
                    for loop in LOOPS:
                        for clip in (1.0, 0.0) if loop == "raw" else (1.0,):
                            out.append({"lib": lib, "stage": stage, "managed": managed,
                                        "clip": clip, "schedule": schedule, "loop": loop})  # fmt: skip
    return out


# ---------------------------------------------------------------- one case in fresh processes
def _rank_main(case: dict, out: str) -> None:
    """Entry point of one rank process (``RANK``, ``WORLD_SIZE``... set by
    :func:`gas_lab.runtime.fresh.run`)."""
    import faulthandler
    import traceback

    from gas_lab.dp import init_from_env

    faulthandler.dump_traceback_later(HANG_S, exit=True)
    init_from_env(timeout_s=HANG_S / 2)  # a collective nobody joins fails, bounded
    path = Path(out) / f"rank{dist.get_rank()}.json"
    try:
        result = run(**case)
        ref = reference(case["managed"], case["clip"], case["schedule"], dist.get_world_size())
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
                                    "message": str(err).splitlines()[0] if str(err) else "",
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
    """Run ``case`` on ``world_size`` fresh rank processes; what each rank did, and the seconds.

    The ranks are forked from a process that imported torch and DeepSpeed once for every case
    (:mod:`gas_lab.runtime.fresh`), in a session of their own: at the timeout it is killed."""
    from gas_lab.runtime import fresh

    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as out:
        target = "gas_lab.measure.idle_rank:_rank_main"
        ran = fresh.run(target, [case, out], out, world_size, timeout, env)
        ranks = []
        for rank in range(world_size):
            result = Path(out) / f"rank{rank}.json"
            log = Path(out) / f"log{rank}.txt"
            text = log.read_text(errors="replace") if log.exists() else ""
            ranks.append(json.loads(result.read_text()) if result.exists() else _from_log(text))
    return {**case, "ranks": ranks, "seconds": round(ran["seconds"], 1)}


def summary(ranks: list[dict]) -> str:
    """One cell of appendix A3's table: what the ranks did, in a few words."""
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
    return {"abort": "aborted by gloo", "hang": "waits, timed out"}.get(
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
