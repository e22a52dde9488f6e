"""The traffic exercise of lessons 05 and 09, written once: the learner predicts the collectives
(calls and bytes, per kind) of runs the lesson did not measure, and the checker measures each
run on the ranks. A lesson gives its runs (:class:`Traffic`), how to measure one on a rank, and
the fixes for the mistakes it knows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gas_lab.lessons.exercises.on_ranks import measured_once
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_predictions
from gas_lab.toys import tiny_model

# measure(run) -> {kind: (calls, bytes)}, on a rank; fix(run, world, got, want) -> str | None
Measure = Callable[["Traffic"], dict]
Fix = Callable[["Traffic", int, dict, dict], "str | None"]


@dataclass(frozen=True)
class Traffic:
    """An optimizer run whose collectives the learner predicts."""

    library: str  # "deepspeed" or "gas_lab"
    stage: int
    managed: bool
    micro_batches: int  # N unmanaged, GAS managed
    clipping: float = 1.0
    hidden: int = 8  # tiny_model's hidden width: 8 gives the lessons' 58 weights
    zero: tuple = ()  # more zero_optimization keys, as (key, value) pairs
    reduce: str | None = None  # gas_lab's ZeRO-1 with lesson 05's textbook reduction

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in tiny_model(0, hidden=self.hidden).parameters())

    def show(self) -> str:
        mode = "managed, GAS" if self.managed else "unmanaged, N ="
        reduce = f", gradients {self.reduce.replace('_', '-')}ed" if self.reduce else ""
        keys = "".join(f", {k} {str(v).lower()}" for k, v in self.zero)
        return (
            f"{self.library}, ZeRO stage {self.stage}{reduce}{keys}, {mode} "
            f"{self.micro_batches}, gradient_clipping {self.clipping}, a model of {self.numel} "
            "weights, one optimizer step"
        )


def traffic_differences(got: dict, want: dict) -> str:
    """What differs between two ``{kind: (calls, bytes)}``, kind by kind, without the measured
    numbers (a first wrong try must not hand out the answer)."""
    parts = []
    for kind in sorted(set(got) | set(want)):
        if kind not in want:
            parts.append(f"you listed {kind}, which the run does not issue")
        elif kind not in got:
            parts.append(f"the run also issues {kind}")
        else:
            for i, what in enumerate(("calls", "bytes")):
                if got[kind][i] != want[kind][i]:
                    side = "too many" if got[kind][i] > want[kind][i] else "too few"
                    parts.append(f"{kind}: {side} {what}")
    return "; ".join(parts)


def measured_traffic(lesson: str, runs: dict, measure: Measure, letter: str, cluster) -> dict:
    """Run ``letter``'s collectives, measured on the ranks (once per session)."""
    return measured_once(
        (f"{lesson} traffic", letter, cluster.world_size),
        lambda: cluster.run(measure, runs[letter], timeout=300)[0],
    )


def judge(t: Traffic, world: int, got, want, fix: Fix) -> Miss | None:
    if not isinstance(got, dict):
        return Miss(f"answer a dict {{kind: (calls, bytes)}}, got {got!r}.")
    got = {k: tuple(int(v) for v in cb) for k, cb in got.items() if tuple(cb) != (0, 0)}
    if got == want:
        return None
    return Miss(traffic_differences(got, want) + ".", fix(t, world, got, want))


def check_traffic_predictions(
    fn: Callable[[], dict],
    cluster,
    lesson: str,
    runs: dict,
    measure: Measure,
    fix: Fix,
    summary: str,
    where: str,
) -> Verdict:
    """``fn()`` returns ``{"A": {"all_reduce": (calls, bytes), ...}, ...}``, per run of
    ``runs``: every kind of collective with its calls and bytes (the full buffer of each call,
    as ``count_collectives`` counts it), on one rank."""

    return check_predictions(
        "predict the traffic",
        fn,
        runs,
        lambda letter: measured_traffic(lesson, runs, measure, letter, cluster),
        lambda letter, got, want: judge(runs[letter], cluster.world_size, got, want, fix),
        case="run",
        example="{'A': {'all_reduce': (1, 232)}, ...}",
        hint=summary,
        where=where,
        module=measure.__module__,  # the lesson's checker module, whose hint() the notebook has
    )
