"""Shared fixtures. ``cluster`` starts the 2 persistent ranks once for the whole test session."""

import pytest


@pytest.fixture(scope="session")
def cluster():
    import gas_lab

    c = gas_lab.start_cluster(world_size=2)
    yield c
    gas_lab.stop_cluster()
