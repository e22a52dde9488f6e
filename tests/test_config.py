"""gas_lab.config: DeepSpeed's defaults and batch arithmetic, stricter key/type checking."""

import os

import pytest
import torch

from gas_lab.config import load_config, resolve_batch
from gas_lab.errors import ConfigError, NotImplementedInGasLab, RejectedCombination
from gas_lab.rules import refusals

os.environ.setdefault("DS_ACCELERATOR", "cpu")

ADAM = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}


def cfg(**kw):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAM, **kw}


# -- defaults ----------------------------------------------------------------------------------
def test_defaults_match_deepspeed():
    from deepspeed.runtime.config import DeepSpeedConfig

    ours = load_config(cfg())
    theirs = DeepSpeedConfig(cfg())
    assert ours.gradient_clipping == theirs.gradient_clipping == 1.0
    assert ours.managed_gradient_accumulation is theirs.managed_gradient_accumulation is True
    assert ours.zero_optimization.stage == theirs.zero_optimization_stage == 0
    assert ours.zero_optimization.overlap is theirs.zero_config.overlap_comm is False
    assert ours.zero_allow_untested_optimizer is theirs.zero_allow_untested_optimizer is False


@pytest.mark.parametrize(
    "opt_type, adam_w_mode, expected",
    [
        ("Adam", None, torch.optim.AdamW),  # the surprise: "Adam" means AdamW
        ("Adam", False, torch.optim.Adam),
        ("adam", None, torch.optim.AdamW),  # DeepSpeed lower-cases its own names
        ("AdamW", None, torch.optim.AdamW),
        ("AdamW", False, torch.optim.AdamW),  # AdamW stays AdamW
        ("SGD", None, torch.optim.SGD),
    ],
)
def test_optimizer_mapping(opt_type, adam_w_mode, expected):
    params = {"lr": 0.1}
    if adam_w_mode is not None:
        params["adam_w_mode"] = adam_w_mode
    c = load_config(cfg(optimizer={"type": opt_type, "params": params}))
    opt = c.optimizer.torch_optimizer(torch.nn.Linear(2, 2).parameters())
    assert type(opt) is expected
    if expected is not torch.optim.SGD:
        # Unset params keep torch's defaults, as in DeepSpeed (AdamW: weight_decay 0.01).
        default = expected([torch.nn.Parameter(torch.zeros(1))]).defaults["weight_decay"]
        assert opt.param_groups[0]["weight_decay"] == default


# -- the batch invariant -------------------------------------------------------------------------
BATCH_CASES = [
    dict(train_batch_size=8),
    dict(train_micro_batch_size_per_gpu=3),
    dict(train_batch_size=12, train_micro_batch_size_per_gpu=2),
    dict(train_batch_size=12, gradient_accumulation_steps=3),
    dict(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=5),
    dict(train_batch_size=12, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=6),
    dict(train_batch_size=10, train_micro_batch_size_per_gpu=3),  # 10 != 3 x 3: refused
    dict(train_batch_size=5, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2),
    dict(gradient_accumulation_steps=4),  # neither batch size: refused
]


@pytest.mark.parametrize("batch", BATCH_CASES)
def test_batch_resolution_agrees_with_deepspeed(batch):
    """World size 1 (DeepSpeedConfig uses 1 without a process group); 2 ranks: test_parity."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        ds = DeepSpeedConfig(dict(batch))
        expected = (
            ds.train_batch_size,
            ds.train_micro_batch_size_per_gpu,
            ds.gradient_accumulation_steps,
        )
    except AssertionError:
        expected = None
    if expected is None:
        with pytest.raises(ConfigError):
            load_config(batch)
    else:
        c = load_config(batch)
        got = (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps)
        assert got == expected
        assert (
            c.train_batch_size == c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps
        )


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_invariant_holds_for_every_world_size(world):
    train, micro, gas = resolve_batch(None, 2, 3, world)
    assert train == micro * gas * world
    assert resolve_batch(train, micro, None, world) == (train, micro, gas)
    assert resolve_batch(train, None, gas, world) == (train, micro, gas)


def test_batch_mismatch_names_the_numbers():
    with pytest.raises(ConfigError) as err:
        resolve_batch(10, 2, 2, 2)
    assert err.value.path == "train_batch_size"
    assert "10 != 2 x 2 x 2" in str(err.value)


# -- keys and types ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config, path",
    [
        (cfg(gradient_acumulation_steps=2), "gradient_acumulation_steps"),
        (cfg(zero_optimization={"stage": 0, "overlapcomm": True}), "zero_optimization.overlapcomm"),
        (cfg(managed_gradient_accumulation="no"), "managed_gradient_accumulation"),
        (cfg(gradient_accumulation_steps="2"), "gradient_accumulation_steps"),
        (cfg(zero_optimization={"stage": 4}), "zero_optimization.stage"),
        (cfg(gradient_clipping=-1.0), "gradient_clipping"),
        (cfg(optimizer={"type": "Adam", "params": {"lrr": 1e-3}}), "optimizer.params.lrr"),
        (cfg(optimizer={"type": "SGD", "params": {"lr": "0.1"}}), "optimizer.params.lr"),
        (cfg(optimizer={"type": "sgd", "params": {}}), "optimizer.type"),  # as in DeepSpeed
        (cfg(optimizer={"type": "Sophia", "params": {}}), "optimizer.type"),
        (cfg(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    ],
)
def test_bad_keys_and_types_name_the_key(config, path):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert err.value.path == path
    assert path in str(err.value) and err.value.reason


def test_deepspeed_keys_written_loosely_still_load():
    c = load_config(
        cfg(
            zero_optimization={"stage": 1, "reduce_bucket_size": 5e8, "overlap_comm": False},
            optimizer={"type": "AdamW", "params": {"lr": 1, "betas": [0.8, 0.9]}},
        )
    )
    assert c.zero_optimization.reduce_bucket_size == 500_000_000
    assert c.optimizer.params["betas"] == (0.8, 0.9)


def test_other_optimizers_are_out_of_scope():
    for name in ("Lamb", "RMSprop"):
        with pytest.raises(NotImplementedInGasLab, match=name):
            load_config(cfg(optimizer={"type": name, "params": {}}))


# -- rules at initialize -------------------------------------------------------------------------
def test_config_enforces_the_rules_data():
    for rule in refusals.RULES:
        if rule.moment != "initialize" or rule.example.pipeline:
            continue
        with pytest.raises(RejectedCombination) as err:
            load_config(refusals.example_config(rule, cfg()))
        assert err.value.rule is rule
        assert rule.reason in str(err.value) and rule.deepspeed_message in str(err.value)


def test_overlap_comm_only_refused_unmanaged_below_stage_2():
    zero = {"stage": 1, "overlap_comm": True}
    assert load_config(cfg(zero_optimization=zero)).zero_optimization.overlap
    with pytest.raises(RejectedCombination, match="overlap_comm"):
        load_config(cfg(zero_optimization=zero, managed_gradient_accumulation=False))


@pytest.mark.parametrize(
    "extra",
    [
        dict(zero_optimization={"stage": 2}, bf16={"enabled": True}),
        dict(zero_optimization={"stage": 2}, communication_data_type="bf16"),
        dict(zero_optimization={"stage": 2, "reduce_scatter": False}),
        dict(zero_optimization={"stage": 2, "round_robin_gradients": True}),
        dict(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}),
        dict(zero_optimization={"stage": 3}),
        dict(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}),
        dict(fp16={"enabled": True}),
        dict(zero_optimization={"stage": 1}, data_types={"grad_accum_dtype": "bf16"}),
        dict(bf16={"enabled": True, "bf16_master_weights_and_grads": True}),
        dict(compile={"deepcompile": True}),
    ],
)
def test_out_of_scope_points_to_deepspeed(extra):
    with pytest.raises(NotImplementedInGasLab, match="deepspeed.initialize"):
        load_config(cfg(**extra))


def test_rules_table_is_complete():
    rows = refusals.table()
    assert len(rows) == len(refusals.RULES) + len(refusals.DEEPSPEED_ONLY)
    assert len(refusals.RULES) >= 7
    assert [r["rule"] for r in rows if r["gas_lab"] == refusals.SAME] == [
        r.name for r in refusals.RULES
    ]
    for row in rows:
        assert row["why"].strip() and row["silent failure it prevents"].strip()
        assert row["when"] in ("initialize", "call", "context")
