"""Reference solutions for lesson 09's exercises (tutorials/09_beyond_zero1.ipynb), and for
appendix A5's (tutorials/A5_memory_and_offload.ipynb), lesson 09's memory side.

Kept apart from the notebook so an instructor can hand out one without the other.
"""

from __future__ import annotations


def traffic_predictions():
    """Exercise 1: one steady optimizer step of each run, on one rank: {kind: (calls, bytes)}."""
    return {
        # 58 weights; buckets of 40 elements: autograd finishes the last layer first, so the
        # biases and the second weight (2 + 16 + 8 = 26) fill one bucket and the 32-element first
        # weight would overflow it: 2 all-reduces per backward (104 + 128 bytes), 3 backward
        # calls, + the 4-byte norm; the all-gather of the padded 60 weights.
        "A": {"all_reduce": (7, 3 * 232 + 4), "all_gather": (1, 240)},
        # ZeRO-3, every weight partitioned: each forward gathers them (232 bytes), each
        # backward reduce-scatters the gradient (232); the step only all-reduces the float64
        # norm (8 bytes).
        "B": {"all_gather": (2, 464), "reduce_scatter": (2, 464), "all_reduce": (1, 8)},
        # 37 weights (148 bytes) padded to 40 (160): 2 gradient all-reduces, the norm even
        # without clipping, the all-gather of the padded vector.
        "C": {"all_reduce": (3, 2 * 148 + 4), "all_gather": (1, 160)},
        # the tiny model's tensors all stay whole: 3 reduce-scatters, the float64 norm, and one
        # all-gather per tensor (4 tensors, 232 bytes in all) after the update.
        "D": {"reduce_scatter": (3, 696), "all_reduce": (1, 8), "all_gather": (4, 232)},
    }


def sum_weight(real, n, total, world):
    """Exercise 2: with the sum nothing divides by W: each real micro-batch weighs 1 / total."""
    return 1.0 / total if real else 0.0


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises import lesson09

    cluster = gas_lab.start_cluster(device="cpu")
    try:
        print(lesson09.check_traffic_predictions(traffic_predictions, cluster))
        print(lesson09.check_sum_weight(sum_weight, cluster))
    finally:
        cluster.stop()
