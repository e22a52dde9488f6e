"""ZeRO-2 (gas_lab/zero2.py) against DeepSpeed 0.19.8 stage 2 on 2 ranks: parameters bit for
bit, counters after every step(), and the collectives of every phase (initialize, each forward,
each backward, each step()) equal in kind, bytes and order; managed and unmanaged, SGD, Adam,
AdamW, clipping on and off, variable N, several buckets per backward()."""

import functools
import importlib
import sys
from pathlib import Path

import pytest
import torch
from parity_support import ADAM, ADAMW, SGD
from parity_support import config as shared_config
from test_zero1 import PartlyFrozen

from gas_lab import initialize
from gas_lab.toys import micro_batch, tiny_model, wide_mlp
from gas_lab.zero2 import PartitionedGradientUpdate, _owned_slices

TESTS = str(Path(__file__).resolve().parent)


def _import_on_rank(name: str):
    """A test module, imported on a rank (the ranks do not start in tests/)."""
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    return importlib.import_module(name)


def config(optimizer, gas, managed=True, **extra):
    return shared_config(optimizer, gas, managed, 2, **extra)


def zero(**keys):
    return {"zero_optimization": {"stage": 2, **keys}}


# ---------------------------------------------------------------- on paper, and on one process
@pytest.mark.parametrize(
    "offset, numel, shard, expected",
    [
        (0, 32, 30, [(0, 0, 30), (1, 30, 2)]),  # the tiny model's first weight at W = 2
        (32, 8, 30, [(1, 0, 8)]),
        (5, 70, 30, [(0, 0, 25), (1, 25, 30), (2, 55, 15)]),  # across three partitions
        (60, 1, 30, [(2, 0, 1)]),
    ],
)
def test_a_parameter_is_cut_at_partition_boundaries(offset, numel, shard, expected):
    assert _owned_slices(offset, numel, shard) == expected


@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _train(stage, optimizer, managed, clip, n_per_step, model_fn=tiny_model):
    cfg = shared_config(optimizer, 3, managed, stage, gradient_clipping=clip)
    model = model_fn(0)
    engine = initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    for step, n in enumerate(n_per_step):
        for micro in range(n):
            x, y = micro_batch(0, step, micro, 0, 2)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            assert all(p.grad is None for p in engine.module.parameters()) or stage < 2
            if managed:
                engine.step()
        if not managed:
            engine.step()
    return engine


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("managed, n_per_step", [(True, [3, 3]), (False, [2, 5, 1])])
@pytest.mark.parametrize("optimizer", [SGD, ADAMW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("model_fn", [tiny_model, PartlyFrozen], ids=["tiny", "partly-frozen"])
def test_stage_2_on_one_process_is_stage_1(managed, n_per_step, optimizer, model_fn):
    two = _train(2, optimizer, managed, 0.05, n_per_step, model_fn)
    one = _train(1, optimizer, managed, 0.05, n_per_step, model_fn)
    assert isinstance(two.strategy, PartitionedGradientUpdate)
    for p, q in zip(two.module.parameters(), one.module.parameters(), strict=True):
        assert (p - q).abs().max().item() <= 1e-6
    assert max((p - q).abs().max() for p, q in zip(
        two.module.parameters(), model_fn(0).parameters(), strict=True)) > 1e-3  # fmt: skip


# ---------------------------------------------------------------- 2 ranks: == DeepSpeed stage 2
def _phase_parity(cfg, kw):
    """On a rank: the same loop on gas_lab and DeepSpeed, each call's collectives recorded."""
    from gas_lab.measure.parity import initializer, train
    from gas_lab.toys import flat_params

    kw = dict(kw)
    if kw.pop("wide", False):
        kw["model_fn"] = functools.partial(wide_mlp, width=512)  # 266,242 weights
    if kw.pop("partly_frozen", False):
        kw["model_fn"] = _import_on_rank("test_zero1").PartlyFrozen
    out = {}
    for lib in ("gas_lab", "deepspeed"):
        phases = []
        engine, counters, losses, _ = train(initializer(lib), cfg, phases=phases, **kw)
        out[lib] = {
            "params": flat_params(engine.module),
            "counters": counters,
            "phases": [(p.what, p.step, p.micro, p.signature()) for p in phases],
            "loss": losses[0],
        }
    return out


CASES = {
    "managed-sgd-gas3": (config(SGD, 3), {}),
    "managed-adam-gas2-noclip": (config(ADAM, 2, gradient_clipping=0.0), {}),
    "managed-adamw-gas3-clip0.05": (config(ADAMW, 3, gradient_clipping=0.05), {}),
    "unmanaged-sgd-varN": (config(SGD, 2, False), {"micro_batches": [1, 3, 2, 4]}),
    "unmanaged-adam-varN-noclip": (
        config(ADAM, 3, False, gradient_clipping=0.0),
        {"micro_batches": [2, 5, 1]},
    ),
    "unmanaged-adamw-noscale-clip0.05": (
        config(ADAMW, 1, False, gradient_clipping=0.05),
        {"micro_batches": [3, 1, 2], "scale_wrt_gas": False},
    ),
    # buckets of 20 elements: several all-reduces per backward(), a weight cut at a partition
    # boundary between two of them, slices packed across parameters
    "unmanaged-adam-small-buckets": (
        config(ADAM, 2, False, **zero(reduce_bucket_size=20)),
        {"micro_batches": [2, 1, 3]},
    ),
    "managed-adam-small-buckets": (config(ADAM, 2, **zero(reduce_bucket_size=7)), {}),
    # 266,242 weights, buckets of 100,000: the 262,144-element weight is larger than a bucket
    "unmanaged-adamw-wide-buckets": (
        config(ADAMW, 2, False, **zero(reduce_bucket_size=100_000)),
        {"micro_batches": [1, 3], "wide": True},
    ),
    "unmanaged-sgd-overlap_comm": (
        config(SGD, 2, False, **zero(overlap_comm=True)),
        {"micro_batches": [3, 1]},
    ),
    "unmanaged-adam-sum": (
        config(ADAM, 2, False, gradient_allreduce_op="sum"),
        {"micro_batches": [2, 3]},
    ),
    "managed-sgd-partly-frozen": (config(SGD, 2), {"partly_frozen": True}),
}


@pytest.mark.ranks
@pytest.mark.parametrize("name", list(CASES))
def test_stage_2_matches_deepspeed_phase_by_phase(cluster, name):
    cfg, kw = CASES[name]
    kw = {"steps": len(kw.get("micro_batches", [0, 0, 0])), **kw}
    ranks = cluster.run(_phase_parity, cfg, kw, timeout=300)
    for out in ranks:
        ours, theirs = out["gas_lab"], out["deepspeed"]
        diff = (ours["params"] - theirs["params"]).abs().max().item()
        assert diff == 0.0, f"{name}: max |gas_lab - DeepSpeed| = {diff:.3g}"  # bit for bit
        assert ours["counters"] == theirs["counters"]
        assert ours["phases"] == theirs["phases"]  # every call: kinds, bytes, order
        backward = [sig for what, _, _, sig in ours["phases"] if what == "backward"]
        assert backward and all(any(k == "all_reduce" for k, _ in sig) for sig in backward)
    assert ranks[0]["gas_lab"]["loss"] != ranks[1]["gas_lab"]["loss"]  # ranks saw other data
    assert torch.equal(ranks[0]["gas_lab"]["params"], ranks[1]["gas_lab"]["params"])


def _by_call(lib, cfg, loop):
    """On a rank: loss.backward() instead of engine.backward(), or coalesce_grad_reduction(),
    or set_gradient_accumulation_boundary(True); parameters, counters, collectives per call."""
    return _import_on_rank("test_zero1")._loop_by_op(lib, cfg, loop)


@pytest.mark.ranks
@pytest.mark.parametrize("loop", ["direct", "coalesce"])
@pytest.mark.parametrize(
    "cfg",
    [config(ADAM, 2), config(SGD, 3, gradient_clipping=0.0)],
    ids=["adam-gas2", "sgd-gas3-noclip"],
)
def test_direct_backward_and_coalescing_match_deepspeed(cluster, cfg, loop):
    for lib_out in cluster.run(_both, cfg, loop, timeout=200):
        ours, theirs = lib_out["gas_lab"], lib_out["deepspeed"]
        assert torch.equal(ours[0], theirs[0])
        assert ours[1:] == theirs[1:]  # counters, and the collectives of every call
        ops = ours[2]
        if loop == "coalesce":  # inside the block nothing moves; leaving it reduces once
            assert all(kinds == [] for op, kinds in ops if op in ("enter", "backward"))
            assert [kinds for op, kinds in ops if op == "exit"] == [["all_reduce"]] * 2
        else:  # every backward reduces, as engine.backward does
            assert all(kinds == ["all_reduce"] for op, kinds in ops if op == "backward")


def _both(cfg, loop):
    return {lib: _by_call(lib, cfg, loop) for lib in ("gas_lab", "deepspeed")}


def _unmanaged_boundary_calls(lib, cfg):
    """On a rank: unmanaged N = 3 then 2; per call, which collectives."""
    import torch
    import torch.distributed as dist

    from gas_lab.measure.comm import count_collectives
    from gas_lab.measure.parity import initializer
    from gas_lab.toys import micro_batch, tiny_model

    model = tiny_model(0)
    engine = initializer(lib)(model=model, model_parameters=model.parameters(), config=cfg)[0]
    calls = []
    for step, n in enumerate([3, 2]):
        for micro in range(n):
            x, y = micro_batch(0, step, micro, dist.get_rank(), 2)
            with count_collectives() as log:
                engine.backward(torch.nn.functional.mse_loss(engine(x), y) / n,
                                scale_wrt_gas=False)  # fmt: skip
            calls.append(("backward", [(c.kind, c.bytes) for c in log.calls]))
        with count_collectives() as log:
            engine.step()
        calls.append(("step", [(c.kind, c.bytes) for c in log.calls]))
    return calls


@pytest.mark.ranks
def test_unmanaged_stage_2_reduces_in_every_backward(cluster):
    """The lesson's point, on gas_lab and on DeepSpeed: N gradient all-reduces per step,
    the boundary step() only the norm and the all-gather."""
    grad_bytes = sum(p.numel() for p in tiny_model(0).parameters()) * 4
    expected = (
        [("backward", [("all_reduce", grad_bytes)])] * 3
        + [("step", [("all_reduce", 4), ("all_gather", 240)])]
        + [("backward", [("all_reduce", grad_bytes)])] * 2
        + [("step", [("all_reduce", 4), ("all_gather", 240)])]
    )
    for lib in ("gas_lab", "deepspeed"):
        for calls in cluster.run(
            _unmanaged_boundary_calls, lib, config(ADAM, 2, False), timeout=120
        ):
            assert calls == expected, lib


def _checkpoint_round_trip(folder, cfg):
    """On a rank: save a stage-2 engine after 2 steps, load it into a fresh one, train both."""
    import torch
    import torch.distributed as dist

    from gas_lab import initialize
    from gas_lab.measure.parity import train
    from gas_lab.toys import flat_params, micro_batch

    a = train(initialize, cfg, 2, [2, 1])[0]
    a.save_checkpoint(folder, tag="t")
    b = train(initialize, cfg, 0)[0]
    b.load_checkpoint(folder, tag="t")
    same_now = torch.equal(flat_params(a.module), flat_params(b.module))
    for engine in (a, b):
        x, y = micro_batch(1, 9, 0, dist.get_rank(), 2)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y), scale_wrt_gas=False)
        engine.step()
    return same_now, torch.equal(flat_params(a.module), flat_params(b.module))


@pytest.mark.ranks
def test_a_stage_2_checkpoint_resumes_exactly(cluster, tmp_path):
    for same_now, same_after in cluster.run(
        _checkpoint_round_trip, str(tmp_path), config(ADAMW, 2, False), timeout=120
    ):
        assert same_now and same_after
