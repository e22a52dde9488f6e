"""Checker for appendix A2 (bf16 and the accumulation dtype), on one process, in a second.

:func:`check_optimizer_gradient`: the gradient DeepSpeed's optimizer receives at the first
update of a bf16 run on 2 ranks at ZeRO stage 0 or 1, bit for bit, from every rank's
micro-batch gradients (bf16, as backward wrote them), the accumulation dtype
(``data_types.grad_accum_dtype``) and the communication dtype (``communication_data_type``).
The data are the appendix's: the tiny model's real micro-batch gradients
(:func:`gas_lab.measure.bf16_gradients.micro_gradients`) for ranks 0 and 1.
``tests/test_appendix_a2_exercises.py`` holds :func:`reference` equal to what DeepSpeed's
optimizer receives on real ranks.

A first wrong try says what differs and where to look; the hint comes on a second try of the
same case or with ``appendix_a2.hint()`` (:mod:`gas_lab.lessons.exercises.verdict`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # appendix_a2.hint()

WORLD = 2  # the ranks the checker plays (the appendix's)


def reference(micro_grads, accumulate, communicate) -> torch.Tensor:
    """What the optimizer receives: each rank adds its micro-batch gradients in ``accumulate``
    (one rounding per addition), hands the sum to the all-reduce in ``communicate``, which adds
    the ranks' sums in that dtype; the mean (a division by W = 2, exact in any order) reaches
    the fp32 master weights as fp32."""
    per_rank = []
    for grads in micro_grads:
        total = grads[0].to(accumulate)
        for g in grads[1:]:
            total = total + g.to(accumulate)
        per_rank.append(total.to(communicate))
    summed = per_rank[0]
    for t in per_rank[1:]:
        summed = summed + t
    return (summed / len(micro_grads)).float()


def _exact(micro_grads) -> torch.Tensor:
    """The mean over ranks of the sum over micro-batches, in float64: no rounding at all."""
    return sum(g.double() for grads in micro_grads for g in grads) / len(micro_grads)


def _variants(micro_grads, accumulate, communicate) -> dict[str, tuple[torch.Tensor, str]]:
    """Other roundings a first answer often makes, each with its fix: a result equal to one
    of them, bit for bit, made that mistake (the first that matches is named)."""
    other = torch.float32 if accumulate == torch.bfloat16 else torch.bfloat16
    out = {
        "accumulate": (
            reference(micro_grads, other, communicate),
            "the micro-batch gradients must add up in `accumulate`: cast the running sum and "
            "each micro-batch's gradient to it before adding.",
        ),
        "no mean": (
            reference(micro_grads, accumulate, communicate) * len(micro_grads),
            "the all-reduce of DeepSpeed's default mean divides the ranks' sum by the world size.",
        ),
    }
    if communicate != accumulate:
        out["communicate"] = (
            reference(micro_grads, accumulate, accumulate),
            "the all-reduce runs in `communicate`: cast each rank's sum to it before the ranks' "
            "sums are added.",
        )
    # Last: with fp32 throughout, "exact" and a missed cast can be the same numbers.
    out["exact"] = (
        _exact(micro_grads).float(),
        "DeepSpeed rounds where the config says: after every micro-batch's addition in "
        "`accumulate`, and where each rank's sum is cast to `communicate`.",
    )
    return out


def _case(fn: Callable, n: int, accumulate, communicate) -> Callable[[], tuple]:
    def run():
        from gas_lab.measure.bf16_gradients import micro_gradients

        grads = [micro_gradients(n, rank=r) for r in range(WORLD)]
        given = [[g.clone() for g in rank] for rank in grads]  # the learner may change them
        return fn(given, accumulate, communicate), grads, accumulate, communicate

    return run


def _judge(result) -> Miss | None:
    got, grads, accumulate, communicate = result
    want = reference(grads, accumulate, communicate)
    if not torch.is_tensor(got):
        return Miss(f"returned {type(got).__name__}; expected a tensor")
    if got.shape != want.shape:
        return Miss(
            f"returned shape {tuple(got.shape)}; expected {tuple(want.shape)}, one "
            "element per parameter element"
        )
    if got.dtype != torch.float32:
        return Miss(
            f"returned {str(got.dtype).removeprefix('torch.')}; the optimizer steps on "
            "fp32 master weights and receives float32",
            "convert the result with .float() at the end.",
        )
    if torch.equal(got, want):
        return None
    exact = _exact(grads)

    def error(x):
        return ((x.double() - exact).norm() / exact.norm()).item()

    differing = int((got != want).sum())
    differs = (
        f"{differing} of {want.numel()} elements differ from what DeepSpeed's optimizer "
        f"receives; relative error against the exact mean: yours {error(got):.2e}, "
        f"DeepSpeed's {error(want):.2e}"
    )
    for variant, fix in _variants(grads, accumulate, communicate).values():
        if torch.equal(got, variant):
            return Miss(differs, fix)
    return Miss(differs)


def check_optimizer_gradient(fn: Callable) -> Verdict:
    """Appendix A2's exercise: ``fn(micro_grads, accumulate, communicate)`` -> the float32
    gradient the optimizer receives; ``micro_grads[r][i]``: rank r's gradient of micro-batch i
    (bf16, already divided by the number of micro-batches)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    return check_cases(
        "the gradient the optimizer receives",
        [
            (
                "accumulate bf16, all-reduce bf16 (the default), N = 16",
                _case(fn, 16, bf16, bf16),
                _judge,
            ),
            (
                "accumulate fp32, all-reduce bf16 (BF16_Optimizer's default), N = 16",
                _case(fn, 16, fp32, bf16),
                _judge,
            ),
            ("accumulate fp32, all-reduce fp32, N = 16", _case(fn, 16, fp32, fp32), _judge),
            ("accumulate bf16, all-reduce bf16, N = 1", _case(fn, 1, bf16, bf16), _judge),
        ],
        "round where the config says: each micro-batch's gradient is added into the running sum "
        "in `accumulate`; each rank's sum is cast to `communicate`; the all-reduce adds the "
        "ranks' sums in `communicate` and the mean divides by W; the optimizer gets float32.",
        where="section 2 (*Build it inline*) for the accumulation, section 4 (*Against "
        "DeepSpeed*) for the communication dtype and the mean",
    )
