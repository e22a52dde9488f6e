"""Reference solution for appendix A5's exercise (tutorials/A5_memory_and_offload.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other.
"""

from __future__ import annotations


def ranks_needed(params, stage, budget):
    """Per parameter 2 + 2 + 12 bytes (bf16 weights and gradients, fp32
    master and Adam moments); what the stage shards is divided by W, the rest is a floor."""
    sharded_from = {"master": 1, "moments": 1, "gradients": 2, "weights": 3}
    size = {"master": 4, "moments": 8, "gradients": 2, "weights": 2}
    whole = sum(size[k] for k in size if stage < sharded_from[k]) * params
    sharded = 16 * params - whole
    if whole + sharded <= budget:
        return 1
    if budget <= whole:  # no number of ranks shrinks the floor
        return None
    return -(-sharded // (budget - whole))  # the smallest W with whole + sharded / W <= budget


if __name__ == "__main__":
    from gas_lab.lessons.exercises.appendix_a5 import check_ranks_needed

    print(check_ranks_needed(ranks_needed))
