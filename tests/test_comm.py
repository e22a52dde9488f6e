"""gas_lab.measure.comm: each logical collective counted once, with its kind, bytes and group size."""

import pytest
import torch.distributed as dist

from gas_lab.measure.comm import CollectiveLog, count_collectives


def test_functions_are_restored_and_nothing_is_counted_without_collectives():
    original = dist.all_reduce
    with count_collectives() as log:
        assert dist.all_reduce is not original
    assert dist.all_reduce is original
    assert len(log) == 0 and log.summary() == "no collectives"


def test_summary_per_step():
    from gas_lab.measure.comm import Collective

    log = CollectiveLog()
    log.calls += [Collective("all_reduce", "torch.distributed.all_reduce", 40, 2)] * 4
    assert log.by_kind() == {"all_reduce": {"calls": 4, "bytes": 160}}
    assert "2 calls per step" in log.summary(steps=2)


def _count():
    import deepspeed
    import torch

    from gas_lab.measure.comm import count_collectives

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the existing group
    t = torch.ones(10)
    with count_collectives() as outer:
        dist.all_reduce(t)  # torch directly
        deepspeed.comm.all_reduce(t)  # DeepSpeed, which calls torch underneath: counted once
        with count_collectives() as inner:
            out = torch.empty(20)
            deepspeed.comm.all_gather_into_tensor(out, torch.ones(10))
        dist.broadcast(t, src=0)
    return (
        [(c.kind, c.function, c.bytes, c.group_size) for c in outer.calls],
        [(c.kind, c.function) for c in inner.calls],
    )


@pytest.mark.ranks
def test_torch_and_deepspeed_calls_counted_once(cluster):
    for outer, inner in cluster.run(_count):
        assert outer == [
            ("all_reduce", "torch.distributed.all_reduce", 40, 2),
            ("all_reduce", "deepspeed.comm.all_reduce", 40, 2),
            ("all_gather", "deepspeed.comm.all_gather_into_tensor", 80, 2),  # full output
            ("broadcast", "torch.distributed.broadcast", 40, 2),
        ]
        assert inner == [("all_gather", "deepspeed.comm.all_gather_into_tensor")]


def _named_and_timed():
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    with count_collectives() as log:
        deepspeed.comm.allgather_fn(torch.empty(20), torch.ones(10))  # DeepSpeed's own name
        dist.all_reduce(torch.ones(3))
    first, second = log.calls
    in_order = first.start_ns < first.end_ns <= second.start_ns < second.end_ns
    return [(c.function, c.op) for c in log.calls], in_order


@pytest.mark.ranks
def test_each_call_is_named_as_the_torch_function_it_reached_and_timed(cluster):
    for named, in_order in cluster.run(_named_and_timed):
        assert named == [
            ("deepspeed.comm.allgather_fn", "all_gather_into_tensor"),
            ("torch.distributed.all_reduce", "all_reduce"),
        ]
        assert in_order
