"""Why a loop failed a case, computed: which known way of weighing the tokens reproduces what it
did, or what a crash or a hang means at that ZeRO stage.

A loop whose weights are wrong is replayed against every recipe of
:func:`~gas_lab.check.mistakes.mistakes`, whatever objective was declared (a built-in
reduction or the user's own); each one that lands on the loop's parameters (to the same
tolerance as the check itself) is a diagnosis. What the checker saw on the ranks narrows them
first: where ``gradient_accumulation_steps`` > 1 and the loop called ``engine.backward`` without
``scale_wrt_gas=False``, only recipes divided by it are replayed (the mechanism, said first), and
where it passed ``scale_wrt_gas=False``, none is. A loop that weighs every target alike is also
fitted with one fixed denominator, which a later pass keeps only if it is the same number in
every failing case. A loop that crashed or hung is explained by the rule of its stage (appendix
A3 measures it).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace

import torch

from gas_lab.check.cases import Case
from gas_lab.check.mistakes import describe, differences, mistakes
from gas_lab.check.objectives import (
    REDUCTIONS,
    Normalization,
    Objective,
    Step,
    Weights,
    reduction,
    targets,
)
from gas_lab.check.trial import SEED, agrees, initial_params, replay

NONE_KNOWN = "none known: no normalization the checker knows reproduces this step"


@dataclass(frozen=True)
class Finding:
    """One known mistake that reproduces a case: its words, what it is (a recipe, ``("fixed",
    number)``, or None for none known), and its place (the mechanism and the simplest first)."""

    words: str
    key: object
    order: int = 0

    @property
    def fixed(self) -> bool:
        return isinstance(self.key, tuple) and self.key[0] == "fixed"


class Replays:
    """Replays of one check (a case's data, the config, the model), each weighting replayed once
    (recipes that weigh a case's targets alike share it)."""

    def __init__(self, config: dict | None, model: str, world_size: int, convention: str):
        self.config, self.model = config, model
        self.world_size, self.convention = world_size, convention
        self._data: dict = {}
        self._params: dict = {}
        self._weights: dict = {}

    def data(self, case: Case) -> list[Step]:
        if case.name not in self._data:
            self._data[case.name] = case.data(SEED, self.world_size, self.convention)
        return self._data[case.name]

    def params(self, case: Case, weights: list[Weights]) -> torch.Tensor:
        key = (case.name, digest(weights))
        if key not in self._params:
            self._params[key] = replay(self.data(case), weights, self.config, self.model)
        return self._params[key]

    def weighed(self, case: Case, n: Normalization, averaged: bool) -> tuple[list, str]:
        """A recipe's weights on the case, and their digest (kept: every stage asks again)."""
        key = (case.name, n, averaged)
        if key not in self._weights:
            weights = [n.weights(s, averaged) for s in self.data(case)]
            self._weights[key] = (weights, digest(weights))
        return self._weights[key]

    def reference(self, case: Case, objective: Objective) -> torch.Tensor:
        return self.params(case, [objective.weights(s) for s in self.data(case)])


def digest(weights: list[Weights]) -> str:
    h = hashlib.sha1()
    for step in weights:
        for row in step:
            h.update(b"|")
            for w in row:
                h.update(str(tuple(w.shape)).encode())
                h.update(w.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _right_recipe(objective: Objective, averaged: bool) -> Normalization | None:
    recipe = objective.recipe
    return recipe if recipe is None or averaged else replace(recipe, factor=1)


def wrong_weights(
    case: Case,
    params: torch.Tensor,
    objective: Objective,
    replays: Replays,
    gas: int = 1,
    scaled: bool | None = None,
    averaged: bool = True,
) -> list[Finding]:
    """Each known mistake that reproduces ``params`` on ``case``, the mechanism and the simplest
    first; a finding of NONE_KNOWN if none. ``scaled``: whether the loop let ``engine.backward``
    divide by ``gas`` (None: not seen). (Where two mistakes weigh this case's targets alike,
    both are named: the case cannot tell them apart.)"""
    data = replays.data(case)
    world = replays.world_size
    reference = digest([objective.weights(s) for s in data])
    right = _right_recipe(objective, averaged)
    named = {}
    if right is not None:  # a recipe equal to another built-in reduction is said as that one
        for r in REDUCTIONS:
            other = replace(reduction(r, right.constant, right.count_empty), factor=right.factor)
            named.setdefault(other, r)
    candidates = mistakes(objective, world, gas, len(data))
    if gas > 1 and scaled is not None:  # what the loop did is known: never name what it did not
        seen = [n for n in candidates if (n.gas == gas) == scaled]
        candidates = seen or candidates
    found = []
    for n in candidates:
        weights, key = replays.weighed(case, n, averaged)
        if key == reference:
            continue  # weighs this case as the objective does: it cannot be what went wrong
        if agrees(params, replays.params(case, weights)):
            order, words = _words(n, right, named, world)
            found.append(Finding(words, n, order))
    fixed = _fixed_denominator(case, params, replays, gas if scaled else 1, averaged)
    if fixed:
        found.append(fixed)
    return sorted(found, key=lambda f: f.order) or [Finding(NONE_KNOWN, None, 99)]


def kept(findings: list[Finding], count_empty: bool) -> list[str]:
    """The words of ``findings``, without a recipe whose twin under the declared empty-sequence
    convention fits as well (the cases left had nothing empty to tell them apart)."""
    keys = {f.key for f in findings}
    out = []
    for f in findings:
        n = f.key
        if isinstance(n, Normalization) and n.count_empty != count_empty:
            if replace(n, count_empty=count_empty) in keys:
                continue
        out.append(f.words)
    return list(dict.fromkeys(out))


def _words(n: Normalization, right: Normalization | None, named: dict, world: int):
    """(how many things it does differently, the words) for a recipe that fits."""
    if right is None:  # a user's objective: the loop's recipe in full
        return (1 + (n.factor != "W") + (n.constant != 1.0) + (n.gas != 1), describe(n, world))
    plain = replace(n, gas=1)
    other = named.get(plain)
    if other is not None and plain != right:  # another built-in reduction, maybe also ÷ GAS
        said = differences(n, plain, world) + [
            f"computes the '{other}' objective, not the one declared"
        ]
        return (len(said) - 1, "the loop " + "; and ".join(said))
    said = differences(n, right, world)
    return (len(said), "the loop " + "; and ".join(said))


def _fixed_denominator(
    case: Case, params: torch.Tensor, replays: Replays, gas: int, averaged: bool
) -> Finding | None:
    """If the loop weighs every target of the case alike, one number it divides by: fitted by a
    few secant steps on the replays (exact in one step with the checker's SGD)."""
    data = replays.data(case)
    world = replays.world_size if averaged else 1
    p0 = initial_params(replays.model)

    def at(c: float) -> torch.Tensor:  # c: the loop's weight per target
        return replays.params(
            case, [[[targets(mb) * c / world for mb in mbs] for mbs in s.ranks] for s in data]
        )

    direction = at(1.0) - p0
    norm = float(direction @ direction)
    if not norm > 0:
        return None
    want = float((params - p0) @ direction) / norm  # the projection a weight c reaches

    def f(c: float) -> float:
        return float((at(c) - p0) @ direction) / norm - want

    if not want > 0:
        return None
    xs, fs = [want], [f(want)]
    if abs(fs[0]) > 1e-7 * abs(want):  # not linear in c (several steps, Adam, clipping)
        xs.append(want * 1.01)
        fs.append(f(xs[-1]))
        for _ in range(4):  # secant steps
            if abs(fs[-1]) <= 1e-7 * abs(want) or fs[-1] == fs[-2]:
                break
            xs.append(xs[-1] - fs[-1] * (xs[-1] - xs[-2]) / (fs[-1] - fs[-2]))
            fs.append(f(xs[-1]))
    c = min(zip(xs, fs, strict=True), key=lambda xf: abs(xf[1]))[0]
    if not c > 0 or not agrees(params, at(c)):
        return None
    d = 1.0 / c
    own = f"{d / gas:.4g}, and engine.backward by gradient_accumulation_steps ({gas})"
    words = (
        "the loop divides each micro-batch's summed loss by the same number, "
        + (own if gas > 1 else f"{d:.4g}")
        + ", whatever the step holds (a fixed denominator, any factor it multiplies by "
        "included), where the objective's weights depend on the step's counts"
    )
    return Finding(words, ("fixed", f"{d:.4g}"), 9)


def raised_by_loop(traceback_text: str) -> bool:
    """Whether the innermost frame of a rank's traceback is the loop's own code (not the
    engine's, DeepSpeed's, torch's or transformers')."""
    files = re.findall(r'^\s*File "([^"]+)"', traceback_text, flags=re.M)
    return bool(files) and not re.search(r"site-packages|/gas_lab/|/torch/", files[-1])


def crash(case: Case, stage: int, hang: bool, by_loop: bool = False, world_size: int = 2) -> str:
    """What a crash or a hang in ``case`` at ``stage`` means, in the course's words."""
    if by_loop:
        return "The loop itself raised (its traceback is above), not the engine."
    counts = case.counts(world_size)
    idle = any(0 in step for step in counts)
    ragged = not case.equal_counts_at(world_size)
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


def config_key(config: dict | None) -> str:
    return json.dumps(config, sort_keys=True)
