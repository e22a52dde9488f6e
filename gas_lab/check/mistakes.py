"""The known mistakes: every recipe the checker replays against a loop that failed, and each
recipe in a learner's words, the mechanism first (what ``engine.backward`` divides by, then what
the loop divides by, then what it multiplies by). :mod:`~gas_lab.check.diagnosis` keeps those
that reproduce the loop's step."""

from __future__ import annotations

from gas_lab.check.objectives import DENOMINATORS, Normalization, Objective

_NO_W = (
    "does not multiply by the world size W (the engine averages the ranks' gradients, so each "
    "rank's share of one global sum needs the factor W)"
)


def _divided_by_gas(gas: int) -> str:
    return (
        f"is divided by gradient_accumulation_steps ({gas}): engine.backward(loss) does that "
        "unless scale_wrt_gas=False, also in unmanaged mode"
    )


def _hard_coded_w(factor, world_size: int) -> str:
    return (
        f"multiplies by {factor}, not by the world size W ({world_size}): a world size written "
        "into the loop"
    )


def mistakes(
    right: Objective, world_size: int, gas: int = 1, steps: int = 1
) -> list[Normalization]:
    """Every recipe the checker replays against a failing loop: each denominator, times W, 1 or
    a hard-coded 2 (where W is not 2), with and without the declared constant, divided by GAS or
    not, either empty-sequence convention where it changes something; a built-in objective's
    own recipe left out."""
    out = []
    for name, den in DENOMINATORS.items():
        if name == "tokens so far" and steps < 2:
            continue
        for factor in ("W", 1) + ((2,) if world_size != 2 else ()):
            for constant in dict.fromkeys((right.constant, 1.0)):
                for g in dict.fromkeys((1, gas)):
                    for count_empty in (False, True) if den.counts else (False,):
                        n = Normalization(name, factor, constant, g, count_empty)
                        if n != right.recipe:
                            out.append(n)
    return out


def describe(n: Normalization, world_size: int, gas_observed: bool = False) -> str:
    """A loop's recipe in a learner's words, the mechanism first: what engine.backward divides
    by, then what the loop divides by, then what it multiplies by."""
    out = []
    if n.gas != 1:
        out.append(_divided_by_gas(n.gas))
    den = DENOMINATORS[n.denominator]
    what = f"divides each micro-batch's summed loss by {den.words}"
    if n.denominator == "one":
        what = "sums the cross-entropy without dividing by a count"
    if n.constant != 1.0:
        what += f", and by the constant {n.constant:g}"
    if den.counts:
        what += (
            f" ({den.counts} with no label counted)"
            if n.count_empty
            else f" ({den.counts} with no label not counted)"
        )
    out.append(what)
    if n.factor == "W":
        out.append(f"multiplies by the world size W ({world_size})")
    elif n.factor == 1:
        out.append(_NO_W)
    else:
        out.append(_hard_coded_w(n.factor, world_size))
    return "the loop " + "; ".join(out)


def differences(got: Normalization, right: Normalization, world_size: int) -> list[str]:
    """What ``got`` does differently from ``right`` (both recipes), in a learner's words, the
    mechanism first; nothing about a factor both share."""
    out = []
    if got.gas != right.gas:
        out.append(_divided_by_gas(got.gas))
    if got.denominator != right.denominator:
        out.append(
            f"divides each micro-batch's summed loss by {DENOMINATORS[got.denominator].words}, "
            f"where the objective divides by {DENOMINATORS[right.denominator].words}"
        )
    if got.count_empty != right.count_empty:
        unit = DENOMINATORS[got.denominator].counts or "sequences"
        same = DENOMINATORS[right.denominator].counts == unit  # the objective counts them too
        out.append(
            f"counts {unit} with no label as {unit}" + (" (the objective does not)" if same else "")
            if got.count_empty
            else f"leaves out {unit} with no label"
            + (" (the objective counts them)" if same else "")
        )
    if got.factor != right.factor:
        if got.factor == 1:
            out.append(_NO_W)
        elif got.factor == "W":
            out.append("multiplies by the world size W, which the objective does not")
        else:
            out.append(_hard_coded_w(got.factor, world_size))
    if got.constant != right.constant:
        out.append(
            f"does not divide by the constant {right.constant:g}"
            if got.constant == 1.0
            else f"divides by the constant {got.constant:g}"
        )
    return out
