"""Reference solution for appendix A2's exercise (tutorials/A2_bf16_accumulation_dtype.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other.
"""

from __future__ import annotations


def optimizer_gradient(micro_grads, accumulate, communicate):
    """The float32 gradient the optimizer receives at ZeRO stage 0 or 1."""
    per_rank = []
    for grads in micro_grads:  # one rank's micro-batch gradients, bf16
        total = grads[0].to(accumulate)
        for g in grads[1:]:
            total = total + g.to(accumulate)  # one rounding per micro-batch, in `accumulate`
        per_rank.append(total.to(communicate))  # what the rank hands the all-reduce
    summed = per_rank[0]
    for t in per_rank[1:]:
        summed = summed + t  # the all-reduce adds in `communicate`
    return (summed / len(micro_grads)).float()  # the mean, into the fp32 master gradient


if __name__ == "__main__":
    from gas_lab.lessons.exercises.appendix_a2 import check_optimizer_gradient

    print(check_optimizer_gradient(optimizer_gradient))
