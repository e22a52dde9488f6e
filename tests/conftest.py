"""Shared fixtures. ``cluster`` starts the 2 persistent ranks once for the whole test session;
``fused`` is the same ranks with DeepSpeed's FusedAdam op built or loaded."""

import pytest


@pytest.fixture(scope="session")
def cluster():
    import gas_lab

    # 2 CPU ranks everywhere, GPU machine or not, so the tests check the same thing everywhere.
    c = gas_lab.start_cluster(world_size=2, device="cpu")
    yield c
    gas_lab.stop_cluster()


@pytest.fixture(autouse=True)
def _first_try():
    """Every test checks an exercise from a first wrong try (the hint comes on the second)."""
    from gas_lab.lessons.exercises.verdict import reset_tries

    reset_tries()


FUSED_BUILD_TIMEOUT = 900  # a cold JIT build of FusedAdam on a loaded 2-core machine


def _load_fused_adam():
    """On a rank: build (first time in this environment) or load DeepSpeed's FusedAdam op."""
    import time

    from deepspeed.ops.op_builder import FusedAdamBuilder

    start = time.perf_counter()
    FusedAdamBuilder().load()
    return time.perf_counter() - start


@pytest.fixture(scope="session")
def fused(cluster):
    """The ranks, with DeepSpeed's FusedAdam op ready (tests of DeepSpeed's default optimizer
    path): a cold build takes minutes, so it waits longer than a call does."""
    seconds = cluster.run(_load_fused_adam, timeout=FUSED_BUILD_TIMEOUT)
    print(f"FusedAdam op ready in {max(seconds):.1f} s (a cold build is the slow case)")
    return cluster
