"""gas_lab == DeepSpeed 0.19.8 on 2 ranks (ZeRO stage 0, fp32): parameters, counters,
collectives, and the refusals of gas_lab/rules/refusals.py."""

import pytest
from parity_support import ADAM, ADAM_L2, ADAMW, SGD, TOL, assert_same, config, run_case

pytestmark = pytest.mark.ranks

CASES = {
    "managed-sgd-gas1": (config(SGD, 1), {}),
    "managed-sgd-gas3": (config(SGD, 3), {}),
    "managed-adam-gas2": (config(ADAM, 2), {}),
    "managed-adam-gas4-noscale": (config(ADAM, 4), {"scale_wrt_gas": False}),
    "managed-adamw-gas3-clip0.05": (config(ADAMW, 3, gradient_clipping=0.05), {}),
    "managed-adam-l2-gas2-noclip": (config(ADAM_L2, 2, gradient_clipping=0.0), {}),
    "managed-sgd-gas2-noclip": (config(SGD, 2, gradient_clipping=0.0), {}),
    "unmanaged-sgd-gas2-varN": (config(SGD, 2, False), {"micro_batches": [1, 3, 2, 4], "steps": 4}),
    "unmanaged-adam-gas3-varN0": (config(ADAM, 3, False), {"micro_batches": [2, 0, 5, 1]}),
    "unmanaged-adamw-gas1-noscale": (
        config(ADAMW, 1, False),
        {"micro_batches": [3, 1, 2], "scale_wrt_gas": False},
    ),
    "unmanaged-adam-gas2-per-rank-N": (config(ADAM, 2, False), {"per_rank_n": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gas_lab_matches_deepspeed(cluster, name):
    cfg, kw = CASES[name]
    results = cluster.run(run_case, cfg, kw, timeout=120)
    assert_same(results, name)
    # The ranks saw different data and still end with the same counters of optimizer steps.
    assert [c["gas_lab"][-1][0] for _, c, _, _ in results] == [results[0][1]["gas_lab"][-1][0]] * 2


def _collectives(cfg, kw, steps):
    from gas_lab.measure.parity import run_parity
    from gas_lab.toys import tiny_model

    r = run_parity(cfg, steps=steps, **kw)
    grad_bytes = sum(p.numel() * p.element_size() for p in tiny_model(0).parameters())
    return r.collectives, grad_bytes


@pytest.mark.parametrize(
    "cfg, kw",
    [
        (config(ADAM, 3), {}),
        (config(ADAM, 3, gradient_clipping=0.0), {}),
        (config(SGD, 2, False), {"micro_batches": [4, 1, 3]}),
    ],
    ids=["managed-clip", "managed-noclip", "unmanaged-varN"],
)
def test_collectives_per_optimizer_step(cluster, cfg, kw):
    steps = 3
    for collectives, grad_bytes in cluster.run(_collectives, cfg, kw, steps, timeout=120):
        assert collectives["gas_lab"] == collectives["deepspeed"]
        # One all-reduce of all gradients per optimizer step, however many micro-batches,
        # plus one of the 4-byte gradient norm when clipping is on.
        clip = cfg.get("gradient_clipping", 1.0) > 0
        per_step = 1 + clip
        assert set(collectives["gas_lab"]) == {"all_reduce"}
        assert collectives["gas_lab"]["all_reduce"]["calls"] == steps * per_step
        assert collectives["gas_lab"]["all_reduce"]["bytes"] == steps * (grad_bytes + 4 * clip)


def _batch_sizes(batches):
    """Batch arithmetic at world size 2, gas_lab vs DeepSpeed's own config class."""
    import torch.distributed as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    from gas_lab.deepspeed_compat.config import load_config
    from gas_lab.errors import ConfigError

    out = []
    for batch in batches:
        try:
            ds = DeepSpeedConfig(dict(batch))
            theirs = (
                ds.train_batch_size,
                ds.train_micro_batch_size_per_gpu,
                ds.gradient_accumulation_steps,
            )
        except AssertionError:
            theirs = "error"
        try:
            c = load_config(batch, world_size=dist.get_world_size())
            ours = (
                c.train_batch_size,
                c.train_micro_batch_size_per_gpu,
                c.gradient_accumulation_steps,
            )
        except ConfigError:
            ours = "error"
        out.append((batch, ours, theirs))
    return out


BATCH_CASES = [
    dict(train_batch_size=8),
    dict(train_batch_size=12, train_micro_batch_size_per_gpu=2),
    dict(train_batch_size=12, gradient_accumulation_steps=3),
    dict(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=5),
    dict(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2),
    dict(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4),
    dict(train_batch_size=6, train_micro_batch_size_per_gpu=2),  # 6 // 2 // 2 = 1: 6 != 4
    dict(train_batch_size=1),  # micro-batches of 0 samples
]


def test_batch_arithmetic_on_two_ranks(cluster):
    for rows in cluster.run(_batch_sizes, BATCH_CASES):
        for batch, ours, theirs in rows:
            assert ours == theirs, batch
        assert any(ours == "error" for _, ours, _ in rows)
        assert any(ours != "error" for _, ours, _ in rows)


def check_rule(rule, base: dict | None = None) -> dict:
    """Run ``rule.example`` on gas_lab and on DeepSpeed; return what each raised (or None)."""
    from gas_lab.deepspeed_compat.engine import initialize as gas_initialize
    from gas_lab.measure.parity import BASE_CONFIG, deepspeed_initialize
    from gas_lab.rules import operations, refusals

    config = refusals.example_config(rule, base or BASE_CONFIG)
    out = {}
    for name, init in (("gas_lab", gas_initialize), ("deepspeed", deepspeed_initialize())):
        try:
            model = operations.model(rule.example.pipeline)
            engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
            operations.perform(engine, rule.example.ops)
            out[name] = None
        except Exception as err:  # the point is to catch and compare whatever is raised
            out[name] = err
    return out


def _rules():
    from gas_lab.rules import refusals

    out = []
    for rule in refusals.RULES:
        raised = check_rule(rule)
        out.append(
            {k: (type(v).__name__, str(v), _types(v)) if v else None for k, v in raised.items()}
        )
    return out


def _types(err) -> list[str]:
    return [c.__name__ for c in type(err).__mro__]


def test_refusals_match_deepspeed(cluster):
    from gas_lab.rules import refusals

    for per_rule in cluster.run(_rules, timeout=120):
        for rule, raised in zip(refusals.RULES, per_rule, strict=True):
            assert raised["gas_lab"] and raised["gas_lab"][0] == "RejectedCombination", rule.name
            assert raised["deepspeed"], f"DeepSpeed no longer refuses {rule.name}"
            ds_type, ds_message, _ = raised["deepspeed"]
            assert ds_type == rule.deepspeed_raises, rule.name
            assert ds_type in raised["gas_lab"][2], rule.name  # catchable as DeepSpeed's
            assert rule.deepspeed_message in ds_message, rule.name


def _manual_loops():
    """Two managed-mode loops that parity.train does not cover, run on both libraries."""
    import torch

    from gas_lab import initialize
    from gas_lab.measure.parity import BASE_CONFIG, deepspeed_initialize
    from gas_lab.toys import micro_batch, tiny_model

    mse = torch.nn.functional.mse_loss
    rank = torch.distributed.get_rank()
    out = {}
    for name, init in (("gas_lab", initialize), ("deepspeed", deepspeed_initialize())):
        # 1. The old way to a variable N: set the boundary by hand, step() once per N.
        model = tiny_model(0)
        engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=BASE_CONFIG)
        counters = []
        for step, n in enumerate([3, 1, 2]):
            for micro in range(n):
                engine.set_gradient_accumulation_boundary(micro == n - 1)
                x, y = micro_batch(0, step, micro, rank, 2)
                engine.backward(mse(engine(x), y))
            engine.step()
            counters.append((engine.global_steps, engine.global_samples, engine.micro_steps))
        params = [p.detach().clone() for p in engine.module.parameters()]
        # 2. The pitfall: the boundary backward() inside no_sync() is never reduced.
        model = tiny_model(0)
        engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=BASE_CONFIG)
        for step in range(2):
            for micro in range(2):
                x, y = micro_batch(0, step, micro, rank, 2)
                with engine.no_sync():
                    engine.backward(mse(engine(x), y))
                engine.step()
        unsynced = [p.detach().clone() for p in engine.module.parameters()]
        out[name] = (counters, params, unsynced)
    return out


def test_set_boundary_and_no_sync_pitfall_match_deepspeed(cluster):
    import torch

    results = cluster.run(_manual_loops, timeout=120)
    for out in results:
        ours, theirs = out["gas_lab"], out["deepspeed"]
        assert ours[0] == theirs[0]  # counters: one micro-step per step() call
        for ours_params, their_params in ((ours[1], theirs[1]), (ours[2], theirs[2])):
            for a, b in zip(ours_params, their_params, strict=True):
                assert (a - b).abs().max().item() <= TOL
    # With the boundary reduction skipped, the two ranks' replicas have silently drifted apart.
    rank0, rank1 = (r["gas_lab"][2] for r in results)
    drift = max((a - b).abs().max().item() for a, b in zip(rank0, rank1, strict=True))
    assert drift > 1e-3
    # Whereas the normal loop keeps them equal.
    same = [torch.equal(a, b) for a, b in zip(*(r["gas_lab"][1] for r in results), strict=True)]
    assert all(same)
