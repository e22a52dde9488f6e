"""Beyond ZeRO-1 (lesson 09), measured on 2 ranks: traffic per optimizer step against N at
stages 0-3 (gas_lab 0-2 and DeepSpeed 0-3 agree), ZeRO-3's phases on DeepSpeed, memory per
rank by category (and the projection that reproduces it), optimizer offload against no
offload, and different N per rank at ZeRO-2/3: the failure, bounded, and the padded loop."""

import pytest
import torch

from gas_lab.measure.memory import CATEGORIES, project_census
from gas_lab.measure.stages import config
from gas_lab.toys import tiny_model, wide_mlp

GRAD = sum(p.numel() for p in tiny_model(0).parameters()) * 4  # 232 bytes
NS = [1, 2, 3, 4]


def _traffic(lib, stage, managed, extra):
    from gas_lab.measure.stages import traffic

    out = traffic(lib, config(stage, managed, **extra), None if managed else NS)
    counted = [p for p in out["phases"] if p.step >= 2]  # after the warm-up
    return out["per_step"], [(p.what, p.step, p.micro, p.signature()) for p in counted]


@pytest.mark.ranks
def test_traffic_per_step_against_n(cluster):
    per_step = {}
    for lib, stages in (("deepspeed", range(4)), ("gas_lab", range(3))):
        for stage in stages:
            for managed in (True, False):
                ranks = cluster.run(_traffic, lib, stage, managed, {}, timeout=120)
                assert ranks[0] == ranks[1]  # both ranks send the same
                per_step[lib, stage, managed] = ranks[0]
    for stage in range(3):  # gas_lab sends what DeepSpeed sends, call by call
        for managed in (True, False):
            assert per_step["gas_lab", stage, managed] == per_step["deepspeed", stage, managed]
    flat = {stage: per_step["deepspeed", stage, False][0] for stage in range(4)}
    assert flat[0] == [GRAD + 4] * 4  # one gradient all-reduce and the norm, whatever N
    assert flat[1] == [GRAD + 4 + 240] * 4  # + the all-gather of the padded weights
    assert flat[2] == [n * GRAD + 4 + 240 for n in NS]  # one gradient all-reduce per backward
    assert flat[3] == [n * GRAD + 8 + GRAD for n in NS]  # one reduce-scatter per backward
    for stage in range(4):  # managed with GAS 4 sends what unmanaged N = 4 sends
        assert per_step["deepspeed", stage, True][0] == [flat[stage][-1]]


@pytest.mark.ranks
def test_zero3_gathers_in_forward_and_reduce_scatters_in_backward(cluster):
    # Parameters under stage3_param_persistence_threshold elements stay whole on every rank
    # (all of the tiny model's, by default); at 0 every forward gathers them.
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    ranks = cluster.run(_traffic, "deepspeed", 3, False, extra, timeout=120)
    per_step, phases = ranks[0]
    assert per_step == [n * 2 * GRAD + 8 for n in NS]
    by_what = {}
    for what, _, _, signature in phases:
        by_what.setdefault(what, set()).add(tuple(signature))
    assert by_what == {
        "forward": {(("all_gather", GRAD),)},
        "backward": {(("reduce_scatter", GRAD),)},
        "step": {(("all_reduce", 8),)},  # the norm, in float64; no gather: fetched on use
    }


def _census(lib, stage, wide, extra):
    from gas_lab.measure.stages import held_memory

    return held_memory(
        lib, config(stage, gas=2, **extra), model_fn=wide_mlp if wide else tiny_model
    )


# The rows a memory table prints (appendix A5), per category and stage: 1,024 weights on 4
# ranks (no padding), one param group. fp32: 4-byte weights and gradients, no master at stage 0
# (the optimizer steps the weights), an fp32 master and Adam's two moments (4 + 8) sharded from
# stage 1. bf16 mixed precision: 2 + 2 bytes of bf16 weights and gradients, 4 + 8 of fp32
# master and moments at every stage. Plus one 4-byte Adam step counter.
ROWS = {
    "fp32": [
        {"weights": 4096, "master": 0, "gradients": 4096, "optimizer state": 8192 + 4},
        {"weights": 4096, "master": 1024, "gradients": 4096, "optimizer state": 2048 + 4},
        {"weights": 4096, "master": 1024, "gradients": 1024, "optimizer state": 2048 + 4},
        {"weights": 1024, "master": 1024, "gradients": 1024, "optimizer state": 2048 + 4},
    ],
    "bf16": [
        {"weights": 2048, "master": 4096, "gradients": 2048, "optimizer state": 8192 + 4},
        {"weights": 2048, "master": 1024, "gradients": 2048, "optimizer state": 2048 + 4},
        {"weights": 2048, "master": 1024, "gradients": 512, "optimizer state": 2048 + 4},
        {"weights": 512, "master": 1024, "gradients": 512, "optimizer state": 2048 + 4},
    ],
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_projected_rows_per_category_and_stage(precision):
    for stage, row in enumerate(ROWS[precision]):
        assert project_census(1024, 4, stage, precision=precision) == row
    # bytes per parameter at stage 0: 4 + 4 + 8 in fp32, 2 + 2 + 12 in bf16 mixed precision
    assert sum(project_census(1024, 4, 0, tensors=0, precision=precision).values()) == 16 * 1024
    with pytest.raises(ValueError, match="precision 'fp16'"):
        project_census(1024, 4, 0, precision="fp16")


@pytest.mark.ranks
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("wide", [False, True], ids=["tiny", "wide-1M"])
def test_memory_per_rank_by_stage(cluster, wide, precision):
    from gas_lab.toys import tiny_model as tiny

    model = (wide_mlp if wide else tiny)(0)
    numel, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    size = 2 if precision == "bf16" else 4  # bytes of a weight and of a gradient
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    got = {}
    for lib, stages in (
        ("gas_lab", range(3 if precision == "fp32" else 2)),
        ("deepspeed", range(4)),
    ):
        for stage in stages:
            got[lib, stage] = cluster.run(_census, lib, stage, wide, extra, timeout=180)
    model_side = CATEGORIES[:4]
    for stage in range(3):
        projected = project_census(numel, 2, stage, tensors if stage == 0 else 1, precision)
        for rank in range(2):
            theirs = got["deepspeed", stage][rank]
            if ("gas_lab", stage) in got:
                ours = got["gas_lab", stage][rank]
                assert {k: ours[k] for k in model_side} == projected  # exactly the projection
            else:  # bf16 at stage 2: gas_lab refuses it; DeepSpeed's rows against the projection
                ours = projected
            for k in ("weights", "master", "optimizer state"):
                assert ours[k] == theirs[k], (stage, k)
            # DeepSpeed keeps whole gradients of the parameters overlapping its shard at
            # stage 2: more than the shard, less than the model.
            if stage < 2:
                assert ours["gradients"] == theirs["gradients"]
            else:
                assert ours["gradients"] < theirs["gradients"] <= size * numel
    three = got["deepspeed", 3][0]
    two = got["deepspeed", 2][0]
    assert three["gradients"] <= two["gradients"]
    if wide:  # the 1M-element weight is partitioned: a rank holds about half the weights
        assert three["weights"] < two["weights"]
    else:  # every tensor is under stage3_param_persistence_threshold: kept whole, and its
        # partition (the size of the master partition, in the weights' dtype) as well
        assert three["weights"] == size * numel + three["master"] * size // 4
    stage3 = project_census(numel, 2, 3, precision=precision)
    for k in ("master", "gradients"):  # per-tensor partitions: within a few elements
        assert abs(three[k] - stage3[k]) <= 4 * tensors
    # the reduction bucket: reduce_bucket_size elements of the gradients' dtype, held at stages
    # 1 (while accumulating) and 3 by DeepSpeed, allocated per backward at stage 2
    bucket = size * 500_000_000
    assert [got["deepspeed", s][0]["bucket"] for s in range(4)] == [0, bucket, 0, bucket]


def _offload(stage, managed, clip, offload):
    from gas_lab.measure.parity import initializer, train
    from gas_lab.measure.stages import held_memory
    from gas_lab.toys import flat_params

    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    cfg = config(stage, managed, zero_optimization=zero, gradient_clipping=clip)
    phases = []
    engine = train(initializer("deepspeed"), cfg, 4, None if managed else [1, 4, 2, 3],
                   phases=phases)[0]  # fmt: skip
    optimizer = type(engine.optimizer.optimizer).__name__
    calls = [(p.what, p.step, p.micro, p.signature()) for p in phases]
    return flat_params(engine.module), calls, optimizer, held_memory("deepspeed", cfg)


@pytest.mark.ranks
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("managed, clip", [(False, 1.0), (False, 0.05), (True, 0.05)])
def test_optimizer_offload_matches_no_offload(cluster, stage, managed, clip):
    plain = cluster.run(_offload, stage, managed, clip, False, timeout=180)
    off = cluster.run(_offload, stage, managed, clip, True, timeout=180)
    for (p0, calls0, opt0, mem0), (p1, calls1, opt1, mem1) in zip(plain, off, strict=True):
        assert (p0 - p1).abs().max().item() <= 1e-6
        assert calls0 == calls1  # the same collectives, call by call
        assert opt0 == opt1 == "AdamW"  # torch_adam: torch's AdamW, on the CPU partition
        # offload keeps a persistent fp32 gradient partition and per-parameter accumulators
        assert mem1["gradients"] > mem0["gradients"] and mem1["weights"] > mem0["weights"]
        assert mem1["optimizer state"] == mem0["optimizer state"]


def _uneven(lib, stage):
    from gas_lab.measure.parity import initializer, train

    train(initializer(lib), config(stage, managed=False), 2, lambda step, rank: 2 + rank)
    return "finished"


@pytest.mark.ranks
@pytest.mark.parametrize("lib, stage", [("gas_lab", 2), ("deepspeed", 3)])
def test_different_n_per_rank_kills_a_rank_at_stage_2_and_3(cluster, lib, stage):
    import gas_lab

    with pytest.raises(gas_lab.RankError) as err:
        cluster.run(_uneven, lib, stage, timeout=60)
    assert err.value.died  # gloo aborts the rank whose collective got the wrong size
    assert cluster.run(lambda: 1) == [1, 1]  # the ranks were restarted


def _padded(lib, stage):
    from gas_lab.lessons.loops import equal_n_train
    from gas_lab.measure.parity import initializer
    from gas_lab.toys import flat_params

    engine, log = equal_n_train(initializer(lib), config(stage, managed=False), 3, _n_per_rank)
    return flat_params(engine.module), log.count("all_reduce"), log.count("reduce_scatter")


def _n_per_rank(step, rank):
    return [(2, 0), (1, 3), (3, 3)][step][rank]  # rank 1 idle in step 0


@pytest.mark.ranks
@pytest.mark.parametrize("lib, stage", [("gas_lab", 2), ("deepspeed", 2), ("deepspeed", 3)])
def test_padding_to_the_longest_rank_trains_right(cluster, lib, stage):
    from gas_lab.measure.parity import reference_params

    ref = reference_params(config(0, managed=False), 3, _n_per_rank, clip=1.0)
    ranks = cluster.run(_padded, lib, stage, timeout=120)
    for params, all_reduces, reduce_scatters in ranks:
        assert (params - ref).abs().max().item() <= 1e-6
        backward_reductions = 2 + 3 + 3  # the longest rank's N, every step, on every rank
        if stage == 2:
            assert all_reduces == backward_reductions + 3  # + the norm of each step
        else:
            assert reduce_scatters == backward_reductions
    assert torch.equal(ranks[0][0], ranks[1][0])
