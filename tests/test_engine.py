"""gas_lab's engine (gas_lab.initialize) on one process: counters, boundary, refusals, and a plain-torch reference.

The 2-rank comparison against DeepSpeed itself is in test_parity.py (and, for ZeRO-1,
coalesce_grad_reduction() and a direct loss.backward(), in test_zero1.py).
"""

import pytest
import torch

from gas_lab import initialize
from gas_lab.errors import ConfigError, NotImplementedInGasLab, RejectedCombination
from gas_lab.toys import micro_batch, tiny_model


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    # No launcher variables: the engine must fall back to world size 1 without a group.
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def make(gas=3, managed=True, optimizer=None, **extra):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "managed_gradient_accumulation": managed,
        "optimizer": optimizer or {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        **extra,
    }
    model = tiny_model(0)
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, opt


def fwd_bwd(engine, step, micro, scale=True):
    x, y = micro_batch(0, step, micro, 0, engine.train_micro_batch_size_per_gpu())
    return engine.backward(torch.nn.functional.mse_loss(engine(x), y), scale_wrt_gas=scale)


def test_initialize_returns_deepspeed_shape():
    engine, opt = make()
    assert isinstance(opt, torch.optim.AdamW)  # "Adam" means AdamW, as in DeepSpeed
    assert engine.optimizer is opt and isinstance(engine.module, torch.nn.Sequential)
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (0, 0, 0)
    assert engine.train_batch_size() == 2 * 3 and engine.gradient_clipping() == 1.0


@pytest.mark.parametrize("gas", [1, 2, 3])
def test_managed_counters(gas):
    engine, _ = make(gas=gas)
    before = [p.detach().clone() for p in engine.module.parameters()]
    for k in range(1, 3 * gas + 2):
        # The boundary is decided by the counter *before* step() increments it.
        assert engine.is_gradient_accumulation_boundary() == (k % gas == 0)
        fwd_bwd(engine, 0, k)
        engine.step()
        assert engine.micro_steps == k
        assert engine.was_step_applied() == (k % gas == 0)
        assert engine.global_steps == k // gas
        assert engine.global_samples == (k // gas) * engine.train_batch_size()
    after = list(engine.module.parameters())
    assert any((a - b).abs().max() > 0 for a, b in zip(after, before, strict=True))


def test_unmanaged_counters_follow_the_micro_batches_actually_run():
    engine, _ = make(gas=3, managed=False)
    per_micro = engine.train_batch_size() // engine.gradient_accumulation_steps()
    samples = 0
    for step, n in enumerate([1, 4, 0, 2]):
        for micro in range(n):
            assert not engine.is_gradient_accumulation_boundary()  # only step() is one
            fwd_bwd(engine, step, micro)
        engine.step()
        samples += n * per_micro
        assert engine.was_step_applied()
        assert (engine.global_steps, engine.micro_steps) == (step + 1, step + 1)
        assert engine.global_samples == samples


def reference(optimizer_cls, lr, steps, n_per_step, gas, scale, clip):
    """Plain torch: accumulate, clip with torch's own clip_grad_norm_, step."""
    model = tiny_model(0)
    # No torch_adam in the config: DeepSpeed's FusedAdam, whose weight_decay default is 0.0.
    defaults = {"weight_decay": 0.0} if optimizer_cls is torch.optim.AdamW else {}
    opt = optimizer_cls(model.parameters(), lr=lr, **defaults)
    for step, n in enumerate(n_per_step[:steps]):
        for micro in range(n):
            x, y = micro_batch(0, step, micro, 0, 2)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / gas if scale else loss).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return list(model.parameters())


@pytest.mark.parametrize("managed", [True, False])
@pytest.mark.parametrize(
    "opt_name, opt_cls", [("SGD", torch.optim.SGD), ("AdamW", torch.optim.AdamW)]
)
@pytest.mark.parametrize("clip, scale", [(1.0, True), (0.0, False), (0.05, True)])
def test_matches_plain_torch(managed, opt_name, opt_cls, clip, scale):
    gas, steps = 3, 3
    n_per_step = [gas] * steps if managed else [2, 5, 1]
    engine, _ = make(
        gas=gas,
        managed=managed,
        optimizer={"type": opt_name, "params": {"lr": 0.05}},
        gradient_clipping=clip,
    )
    for step, n in enumerate(n_per_step):
        for micro in range(n):
            fwd_bwd(engine, step, micro, scale)
            if managed:
                engine.step()
        if not managed:
            engine.step()
    expected = reference(opt_cls, 0.05, steps, n_per_step, gas, scale, clip)
    for ours, ref in zip(engine.module.parameters(), expected, strict=True):
        assert (ours - ref).abs().max().item() <= 1e-6


def test_backward_returns_the_scaled_loss():
    engine, _ = make(gas=4)
    x, y = micro_batch(0, 0, 0, 0, 2)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    assert torch.allclose(engine.backward(loss.detach().requires_grad_()), loss / 4)


def test_set_boundary_overrides_the_counter_when_managed():
    engine, _ = make(gas=3)
    engine.set_gradient_accumulation_boundary(True)
    for k in range(2):
        fwd_bwd(engine, 0, k)
        engine.step()
        assert engine.was_step_applied() and engine.global_steps == k + 1
    engine.set_gradient_accumulation_boundary(False)
    for k in range(4):
        fwd_bwd(engine, 1, k)
        engine.step()
    assert engine.global_steps == 2  # stays overridden until set again


# Unmanaged set_gradient_accumulation_boundary() and coalesce_grad_reduction(), and coalescing at
# stage 0, are refused on this engine with their message at their moment by
# tests/test_rules.py::test_rule_fires_on_the_engine_with_its_message_at_its_moment.


@pytest.mark.parametrize("managed", [True, False])
def test_step_inside_no_sync_is_refused(managed):
    engine, _ = make(managed=managed)
    with engine.no_sync():
        fwd_bwd(engine, 0, 0)
        with pytest.raises(RejectedCombination, match="no_sync"):
            engine.step()
        with pytest.raises(RejectedCombination, match="reentry|inner"):
            with engine.no_sync():
                pass
    assert not engine.inside_no_sync_ctxt
    engine.step()  # fine once outside


def test_pipeline_models_are_refused_or_out_of_scope():
    class PipelineModule(torch.nn.Sequential):  # detected by name, like DeepSpeed's class
        pass

    model = PipelineModule(torch.nn.Linear(2, 2))
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {}}}
    with pytest.raises(RejectedCombination, match="pipeline"):
        initialize(model=model, config={**base, "managed_gradient_accumulation": False})
    with pytest.raises(NotImplementedInGasLab, match="Pipeline"):
        initialize(model=model, config=base)


def test_unsupported_deepspeed_arguments_are_refused_not_ignored():
    model = tiny_model(0)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {}}}
    with pytest.raises(NotImplementedInGasLab, match="mpu"):
        initialize(model=model, config=config, mpu=object())
    with pytest.raises(NotImplementedInGasLab, match="mesh_param"):
        initialize(model=model, config=config, mesh_param=(2, 1))
    engine, _, loader, scheduler = initialize(model=model, config=config, training_data=None)
    assert loader is None and scheduler is None


# ---------------------------------------------------------------- DeepSpeed's initialize() call
SGD_CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {}}}


def test_initialize_takes_deepspeeds_signature():
    import inspect

    import deepspeed

    ours = inspect.signature(initialize).parameters
    theirs = inspect.signature(deepspeed.initialize).parameters
    assert list(ours)[: len(theirs)] == list(theirs)  # positional calls mean the same
    for name, param in theirs.items():
        assert ours[name].default == param.default, name


def test_the_config_comes_as_deepspeed_takes_it(tmp_path):
    import argparse
    import base64
    import json

    path = tmp_path / "ds_config.json"
    path.write_text("// DeepSpeed reads hjson: comments too\n" + json.dumps(SGD_CONFIG))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=-1)
    encoded = base64.urlsafe_b64encode(json.dumps(SGD_CONFIG).encode()).decode()
    for kw in (dict(config=str(path)), dict(config=path), dict(config_params=SGD_CONFIG),
               dict(args=args), dict(config=encoded)):  # fmt: skip
        engine = initialize(model=tiny_model(0), **kw)[0]
        assert engine.train_micro_batch_size_per_gpu() == 2, kw
    assert args.local_rank == engine.local_rank == 0  # set as DeepSpeed sets it
    with pytest.raises(ConfigError, match="given twice") as err:
        initialize(args=args, model=tiny_model(0), config=SGD_CONFIG)
    assert isinstance(err.value, AssertionError)  # what DeepSpeed raises
    with pytest.raises(ConfigError, match="none given"):
        initialize(args=argparse.Namespace(deepspeed_config=None), model=tiny_model(0))
    with pytest.raises(ConfigError, match="neither a JSON file"):
        initialize(model=tiny_model(0), config=str(tmp_path / "missing.json"))
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(ConfigError, match="appears twice"):
        initialize(model=tiny_model(0), config=str(path))


def test_dist_init_required_false_needs_a_process_group():
    with pytest.raises(ValueError, match="dist_init_required"):
        initialize(model=tiny_model(0), config=SGD_CONFIG, dist_init_required=False)


@pytest.mark.parametrize("stage", [0, 1])
def test_the_names_training_loops_read(stage):
    engine, _ = make(gas=2, zero_optimization={"stage": stage},
                     zero_allow_untested_optimizer=True)  # fmt: skip
    assert (engine.local_rank, engine.global_rank, engine.world_size) == (0, 0, 1)
    assert engine.dp_world_size == 1 and engine.data_parallel_group is None
    assert engine.device == torch.device("cpu") and engine.mpu is None
    assert not engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.zero_optimization() == (stage > 0)
    for micro in range(2):
        fwd_bwd(engine, 0, micro)
        engine.step()
    # DeepSpeed keeps the gradient norm of the last update at ZeRO stages 1 and 2 only.
    norm = engine.get_global_grad_norm()
    assert (norm is None) if stage == 0 else norm > 0


# ---------------------------------------------------------------- a direct loss.backward()
def direct(engine, step, micro, loss_fn=None):
    x, y = micro_batch(0, step, micro, 0, engine.train_micro_batch_size_per_gpu())
    (loss_fn or torch.nn.functional.mse_loss)(engine(x), y).backward()


@pytest.mark.parametrize("managed", [True, False])
def test_direct_backward_is_refused_at_stage_0_before_any_gradient(managed):
    engine, _ = make(managed=managed)
    with pytest.raises(RejectedCombination) as err:
        direct(engine, 0, 0)  # raised from inside loss.backward(), by the hook on the output
    message = str(err.value)
    assert err.value.rule.name == "tensor_backward_stage0"
    assert "loss.backward()" in message and "raises RuntimeError at call" in message
    assert all(p.grad is None for p in engine.module.parameters())
    # The refusal leaves the engine usable: the same step through engine.backward() is fine.
    fresh, _ = make(managed=managed)
    for e in (engine, fresh):
        for micro in range(3):
            fwd_bwd(e, 0, micro)
            if managed:
                e.step()
        if not managed:
            e.step()
    for ours, ref in zip(engine.module.parameters(), fresh.module.parameters(), strict=True):
        assert torch.equal(ours, ref)


def _counting_reductions(engine):
    calls = []
    reduce = engine.strategy.reduce_gradients
    engine.strategy.reduce_gradients = lambda: (calls.append(engine.micro_steps), reduce())[1]
    return calls


@pytest.mark.parametrize("managed, ns", [(True, [3, 3]), (False, [2, 4])])
def test_direct_backward_at_stage_1_is_engine_backward_without_the_sample_count(managed, ns):
    engines, reductions = {}, {}
    for kind in ("engine", "direct"):
        engine, _ = make(gas=3, managed=managed, zero_optimization={"stage": 1})
        reductions[kind] = _counting_reductions(engine)
        for step, n in enumerate(ns):
            for micro in range(n):
                fwd_bwd(engine, step, micro) if kind == "engine" else direct(engine, step, micro)
                if managed:
                    engine.step()
            if not managed:
                engine.step()
        engines[kind] = engine
    ours, ref = engines["direct"], engines["engine"]
    for a, b in zip(ours.module.parameters(), ref.module.parameters(), strict=True):
        # Divided by GAS at the output instead of at the loss: equal up to float32 rounding.
        assert (a - b).abs().max().item() <= 1e-6
    assert reductions["direct"] == reductions["engine"] == ([2, 5] if managed else [0, 1])
    assert (ours.global_steps, ours.micro_steps) == (ref.global_steps, ref.micro_steps)
    # DeepSpeed counts samples in engine.backward(); unmanaged, a direct backward adds none.
    assert ours.global_samples == (ref.global_samples if managed else 0) and ref.global_samples


class TwoHeads(torch.nn.Module):
    """Returns a dict of two outputs: one backward pass reaches the engine's hooks twice."""

    def __init__(self):
        super().__init__()
        self.body = tiny_model(0)

    def forward(self, x):
        out = self.body(x)
        return {"a": out[:, :1], "b": (out[:, 1:], out.sum(1, keepdim=True))}


def test_direct_backward_through_several_outputs_divides_each_and_reduces_once():
    def loss_fn(out, y):
        return ((out["a"] - y[:, :1]) ** 2).mean() + out["b"][0].mean() * out["b"][1].mean()

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
    }
    grads = {}
    for kind in ("engine", "direct"):
        engine = initialize(model=TwoHeads(), config=config)[0]
        calls = _counting_reductions(engine)
        x, y = micro_batch(0, 0, 0, 0, 2)
        loss = loss_fn(engine(x), y)
        engine.backward(loss) if kind == "engine" else loss.backward()
        grads[kind] = [p.grad.clone() for p in engine.module.parameters()]
        engine.step()  # micro-step 0 of 2: not the boundary
        x, y = micro_batch(0, 0, 1, 0, 2)
        loss = loss_fn(engine(x), y)
        engine.backward(loss) if kind == "engine" else loss.backward()
        assert calls == [1]  # the boundary backward reduced once, not once per output
    for a, b in zip(grads["direct"], grads["engine"], strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=0)


# ---------------------------------------------------------------- coalesce_grad_reduction()
def test_coalesce_at_zero1_reduces_once_on_leaving_and_refuses_what_deepspeed_refuses():
    engine, _ = make(gas=2, zero_optimization={"stage": 1})
    calls = _counting_reductions(engine)
    with engine.coalesce_grad_reduction():
        assert engine.inside_no_sync_ctxt
        for micro in range(2):
            fwd_bwd(engine, 0, micro)
        assert calls == []  # backward() keeps the gradients local inside the block
        with pytest.raises(RejectedCombination, match="inside no_sync"):
            engine.step()
        with pytest.raises(RejectedCombination, match="reentry"):
            engine.no_sync().__enter__()
    assert calls == [0] and not engine.inside_no_sync_ctxt  # one reduction, on leaving
    engine.step()
    assert not engine.was_step_applied()  # micro-step 0 of 2
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1 and calls == [0]


# ---------------------------------------------------------------- the strategy's interface
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_every_stage_builds_a_strategy_with_every_method_the_engine_calls(stage):
    """The engines call a strategy through the two Protocols only: the floor's ``Strategy``
    (``after_backward``, ``reduce_gradients``, ``update``) and ``DeepSpeedStrategy`` (those and
    ``before_backward``, ``defer_reduction``, ``destroy``, ``last_norm``)."""
    from gas_lab.deepspeed_compat.strategies import DeepSpeedStrategy
    from gas_lab.engine import Strategy

    engine, _ = make(zero_optimization={"stage": stage}, zero_allow_untested_optimizer=True)
    assert isinstance(engine.strategy, DeepSpeedStrategy)
    assert isinstance(engine.strategy, Strategy)
    fwd_bwd(engine, 0, 0)
    assert engine.get_global_grad_norm() is None  # no update yet (stage 0: never one)
    engine.destroy()


def test_the_floors_strategies_are_strategies_and_the_engines_ask_no_getattr():
    import inspect

    import gas_lab.deepspeed_compat.engine as deepspeed_engine
    import gas_lab.engine as floor
    from gas_lab.engine import AllReduce, Strategy
    from gas_lab.zero1 import ShardedUpdate
    from gas_lab.zero2 import PartitionedGradientUpdate

    for cls in (AllReduce, ShardedUpdate, PartitionedGradientUpdate):
        params = list(tiny_model(0).parameters())
        assert isinstance(cls(params, torch.optim.SGD(params, lr=0.1)), Strategy), cls
    for module in (floor, deepspeed_engine):
        assert "getattr(self.strategy" not in inspect.getsource(module), module.__name__
