"""Why a loop failed a case, computed: which known normalization reproduces what it did, or what
a crash or a hang means at that ZeRO stage.

A loop whose weights are wrong is replayed against every normalization of
:func:`~gas_lab.check.objectives.mistakes`; each one that lands on the loop's parameters (to the
same tolerance as the check itself) is a diagnosis, said as what the loop does differently. A
loop that crashed or hung is explained by the rule of its stage (appendix A3 measures it).
"""

from __future__ import annotations

import json
import re

from gas_lab.check.cases import Case
from gas_lab.check.objectives import (
    REDUCTIONS,
    Normalization,
    differences,
    mistakes,
    objective,
)
from gas_lab.check.trial import agrees, replay

NONE_KNOWN = "none known: no normalization the checker knows reproduces this step"


_REPLAYS: dict = {}  # (case, normalization, config) -> parameters: the same at every stage


def replayed(case: Case, n: Normalization, config: dict | None):
    key = (case.name, n, json.dumps(config, sort_keys=True))
    if key not in _REPLAYS:
        _REPLAYS[key] = replay(case.data(), n, config)
    return _REPLAYS[key]


def wrong_weights(
    case: Case, params, right: Normalization, config: dict | None, gas: int
) -> list[str]:
    """Each known mistake that reproduces ``params`` on ``case``, in words, the one that differs
    from the objective in fewest ways first; [NONE_KNOWN] if none. (Where two mistakes weigh
    this case's tokens alike, both are named: the cases cannot tell them apart.)"""
    named = {objective(r, right.constant, right.count_empty): r for r in REDUCTIONS}
    found = []  # (how many things it does differently, the words): the simplest first
    for n in mistakes(right, gas, len(case.steps)):
        if agrees(params, replayed(case, n, config)):
            other = named.get(n)
            if other is not None:
                found.append(
                    (1, f"the loop computes the '{other}' objective, not the one declared")
                )
            else:
                said = differences(n, right)
                found.append((len(said), "the loop " + "; and ".join(said)))
    return [words for _, words in sorted(found, key=lambda f: f[0])] or [NONE_KNOWN]


def raised_by_loop(traceback_text: str) -> bool:
    """Whether the innermost frame of a rank's traceback is the loop's own code (not the
    engine's, DeepSpeed's or torch's)."""
    files = re.findall(r'^\s*File "([^"]+)"', traceback_text, flags=re.M)
    return bool(files) and not re.search(r"site-packages|/gas_lab/|/torch/", files[-1])


def crash(case: Case, stage: int, hang: bool, by_loop: bool = False) -> str:
    """What a crash or a hang in ``case`` at ``stage`` means, in the course's words."""
    if by_loop:
        return "The loop itself raised (its traceback is above), not the engine."
    counts = case.counts()
    idle = any(0 in step for step in counts)
    ragged = not case.equal_counts
    if ragged and stage >= 2:
        return (
            f"At ZeRO stage {stage} every backward() reduces its gradients across the ranks, so "
            "the k-th backward() of one rank meets the k-th of every other: every rank must make "
            "the same number of backward() calls. A rank with fewer micro-batches makes up the "
            "difference with zero-weight micro-batches (any micro-batch, its loss multiplied by "
            "0), and a rank with none too."
        )
    if idle and stage == 1:
        return (
            "At ZeRO stage 1, step() reduces the gradients this rank's backward() calls "
            "produced, and a rank that made none has nothing to reduce. A rank with no "
            "micro-batch runs one zero-weight micro-batch (its loss multiplied by 0)."
        )
    if hang:
        return (
            "The ranks did not make the same collective calls, so one waited for the other. If "
            "the loop all-reduces a count, every rank must call it, a rank without micro-batches "
            "too, and the same number of times."
        )
    return "The engine raised inside the loop's call: its traceback is above."
