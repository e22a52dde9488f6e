"""Shared fixtures. ``cluster`` starts the 2 persistent ranks once for the whole test session."""

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
