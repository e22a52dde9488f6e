"""gas_lab.deepspeed_compat.config: DeepSpeed's defaults and batch arithmetic, stricter key/type checking."""

import os
import sys

import pytest
import torch
from config_support import deepspeed_builds, gas_lab_builds

from gas_lab.deepspeed_compat import keys as deepspeed_keys
from gas_lab.deepspeed_compat import optimizers
from gas_lab.deepspeed_compat.config import load_config, resolve_batch
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


# -- the optimizer, per DeepSpeed path (gas_lab/deepspeed_compat/optimizers.py) -----------------------------------
TYPES = ("Adam", "AdamW", "adam", "adamw", "ADAM")
SWITCH_VALUES = ("absent", True, False, None, 0, 1)


def _block(kind, torch_adam="absent", adam_w_mode="absent", **params):
    switches = {"torch_adam": torch_adam, "adam_w_mode": adam_w_mode}
    params.update({k: v for k, v in switches.items() if v != "absent"})
    return {"type": kind, "params": params}


COMPARED = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov")


def _same_build(block, monkeypatch):
    theirs, their_hp = deepspeed_builds(block, monkeypatch)
    ours, our_hp = gas_lab_builds(block)
    assert ours == theirs, block
    for key in COMPARED:
        if key in their_hp:  # FusedAdam has no amsgrad; bias_correction (true) is not torch's
            ours_v, theirs_v = (v if not isinstance(v, list) else tuple(v)
                                for v in (our_hp[key], their_hp[key]))  # fmt: skip
            # A null flag is false to both (DeepSpeed passes it on; gas_lab drops it).
            assert ours_v == theirs_v or (not ours_v and theirs_v is None), (block, key)
    return ours, our_hp


@pytest.mark.parametrize("kind", TYPES)
def test_optimizer_per_path_is_what_deepspeed_builds(kind, monkeypatch):
    """Every type x torch_adam x adam_w_mode: the class (FusedAdam: its mode) and every
    hyper-parameter, defaults included, equal DeepSpeed 0.19.8's own construction."""
    seen = set()
    for torch_adam in SWITCH_VALUES:
        for adam_w_mode in SWITCH_VALUES[:5]:
            for params in ({}, {"lr": 0.1}, {"weight_decay": 0.1, "betas": [0.8, 0.9]}):
                block = _block(kind, torch_adam, adam_w_mode, **params)
                seen.add(_same_build(block, monkeypatch)[0])
    expected = {"FusedAdam/AdamW", "AdamW"}
    if kind.lower() == "adam":
        expected |= {"FusedAdam/Adam", "Adam"}  # adam_w_mode false, 0 or null: Adam + L2
    assert seen == expected


def test_fused_path_defaults_are_deepspeeds_not_torchs():
    """The reason for all this: no torch_adam means weight_decay 0.0, not AdamW's 0.01."""
    plan = load_config(cfg(optimizer={"type": "Adam", "params": {}})).optimizer.plan()
    assert plan.path == "fused" and plan.deepspeed_builds == "FusedAdam(adam_w_mode=1)"
    assert plan.cls is torch.optim.AdamW and plan.kwargs["weight_decay"] == 0.0
    assert torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"] == 0.01
    torch_path = load_config(cfg()).optimizer.plan()  # ADAM has torch_adam: true
    assert torch_path.path == "torch" and "weight_decay" not in torch_path.kwargs
    table = optimizers.table()
    assert {r["DeepSpeed builds"] for r in table} >= {"FusedAdam(adam_w_mode=1)",
                                                     "FusedAdam(adam_w_mode=0)"}  # fmt: skip


@pytest.mark.parametrize(
    "block",
    [
        {"type": "SGD", "params": {}},
        {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
        {"type": "SGD", "params": {"lr": 0.1, "nesterov": None, "weight_decay": 0.01}},
        _block("Adam", True, amsgrad=True),
        _block("Adam", amsgrad=None),
        _block("Adam", True, foreach=True, maximize=False),
    ],
)
def test_other_blocks_are_what_deepspeed_builds(block, monkeypatch):
    _same_build(block, monkeypatch)


@pytest.mark.parametrize(
    "block, path, raises",
    [
        ({"type": "sgd", "params": {}}, "optimizer.type", AssertionError),
        ({"type": "Sgd", "params": {}}, "optimizer.type", AssertionError),
        (_block("Adam", amsgrad=True), "optimizer.params.amsgrad", RuntimeError),
        (_block("Adam", True, lr=None), "optimizer.params.lr", TypeError),
        (_block("AdamW", True, eps=None), "optimizer.params.eps", TypeError),
        (_block("Adam", True, weight_decay=None), "optimizer.params.weight_decay", TypeError),
        (_block("Adam", True, betas=None), "optimizer.params.betas", TypeError),
        ({"type": "SGD", "params": {"lr": None}}, "optimizer.params.lr", TypeError),
        ({"type": "SGD", "params": {"momentum": None}}, "optimizer.params.momentum", TypeError),
        ({"type": "SGD", "params": {"torch_adam": True}}, "optimizer.params.torch_adam", TypeError),
        (_block("Adam", True, bias_correction=True), "optimizer.params.bias_correction", TypeError),
        (_block("Adam", lrr=0.1), "optimizer.params.lrr", TypeError),
    ],
)
def test_refused_as_deepspeed_refuses(block, path, raises, monkeypatch):
    """Where DeepSpeed's construction raises, gas_lab raises an error of the same type that
    names the key."""
    with pytest.raises(raises):
        deepspeed_builds(block, monkeypatch)
    with pytest.raises(ConfigError) as err:
        load_config(cfg(optimizer=block))
    assert isinstance(err.value, raises) and err.value.path == path
    assert path in str(err.value)


@pytest.mark.parametrize(
    "params, path",
    [
        ({"lr": None}, "optimizer.params.lr"),  # DeepSpeed: TypeError at the first step
        ({"betas": None}, "optimizer.params.betas"),
        ({"lr": "1e-2"}, "optimizer.params.lr"),
        ({"lr": -1e-3}, "optimizer.params.lr"),  # FusedAdam would climb the loss
        ({"weight_decay": -0.1}, "optimizer.params.weight_decay"),  # FusedAdam ignores it
        ({"eps": float("nan")}, "optimizer.params.eps"),
        ({"betas": [0.9, 1.0]}, "optimizer.params.betas"),
        ({"betas": [0.9]}, "optimizer.params.betas"),
        ({"adam_w_mode": "no"}, "optimizer.params.adam_w_mode"),  # truthy in DeepSpeed
        ({"torch_adam": "false"}, "optimizer.params.torch_adam"),
        ({"max_grad_norm": None}, "optimizer.params.max_grad_norm"),
    ],
)
def test_fused_path_refusals_name_the_key(params, path):
    with pytest.raises(ConfigError) as err:
        load_config(cfg(optimizer={"type": "Adam", "params": params}))
    assert err.value.path == path and path in str(err.value)


def test_not_modelled_optimizer_keywords_are_not_supported():
    for block in (_block("Adam", False, bias_correction=False), _block("Adam", True, fused=True)):
        with pytest.raises(NotImplementedInGasLab, match="not supported by gas_lab"):
            load_config(cfg(optimizer=block))


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
        (cfg(gradient_clipping=float("nan")), "gradient_clipping"),
        (cfg(gradient_clipping=None), "gradient_clipping"),
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
    assert c.optimizer.plan().kwargs["betas"] == (0.8, 0.9)


# -- DeepSpeed's keys: read, accepted and ignored, not supported, or removed --------------------
# Top-level keys deepspeed.initialize + one step read at ZeRO 0 and 1 (traced on 0.19.8 by
# wrapping the config dict's lookups; other engines, e.g. pipeline or inference, read more).
DEEPSPEED_TOP_LEVEL = """activation_checkpointing aio amp autotuning bf16 bfloat16 checkpoint comet
    comms_logger communication_data_type compile compression_training csv_monitor
    curriculum_learning data_efficiency data_types dataloader_drop_last datastates_ckpt
    disable_allgather disable_python_gc dump_state eigenvalue elasticity expert_parallel
    flops_profiler fp16 gradient_accumulation_steps gradient_allreduce_op gradient_clipping
    gradient_predivide_factor graph_harvesting hybrid_engine log_level
    managed_gradient_accumulation memory_breakdown nebula optimizer pipeline prescale_gradients
    progressive_layer_drop quantize_training scheduler seq_parallel_communication_data_type
    sequence_parallel_size sparse_attention sparse_gradients steps_per_print tensor_parallel
    tensorboard timers torch_autocast train_batch_size train_micro_batch_size_per_gpu
    use_data_before_expert_parallelism vocabulary_size wall_clock_breakdown wandb
    weight_quantization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
    zero_optimization""".split()


def test_every_deepspeed_key_is_modelled_or_refused_by_name():
    """No key DeepSpeed reads gets "check the spelling": gas_lab models it, or refuses it as
    not supported / removed. Sections are compared with DeepSpeed's own pydantic models."""
    from deepspeed.compile.config import CompileConfig
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    from gas_lab.deepspeed_compat.config import GasConfig, ZeroConfig

    modelled = set(GasConfig.model_fields) - {"world_size"}
    refused = deepspeed_keys.NOT_SUPPORTED | deepspeed_keys.REMOVED
    assert set(DEEPSPEED_TOP_LEVEL) == modelled | refused
    assert not modelled & refused
    zero_names = set(DeepSpeedZeroConfig.model_fields) | {
        f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias
    }
    ours = set(ZeroConfig.model_fields)
    assert zero_names == ours | deepspeed_keys.ZERO_NOT_SUPPORTED
    for theirs, mine in (
        (DeepSpeedFP16Config, deepspeed_keys.Fp16Section),
        (CompileConfig, deepspeed_keys.CompileSection),
        (DeepSpeedZeroOffloadOptimizerConfig, deepspeed_keys.OffloadOptimizerSection),
        (DeepSpeedZeroOffloadParamConfig, deepspeed_keys.OffloadParamSection),
    ):
        assert set(theirs.model_fields) == set(mine.model_fields), mine.__name__


@pytest.mark.parametrize("key", sorted(deepspeed_keys.NOT_SUPPORTED))
def test_deepspeed_keys_gas_lab_lacks_are_not_supported(key):
    with pytest.raises(NotImplementedInGasLab, match=f"'{key}'.*not supported by gas_lab"):
        load_config(cfg(**{key: {}}))


@pytest.mark.parametrize(
    "extra, path",
    [
        (dict(sparse_attention=None), "sparse_attention"),  # removed: refused even as null
        (dict(zero_optimization={"stage": 0, "mics_shard_size": 2}), "zero_optimization.mics"),
    ],
)
def test_removed_deepspeed_keys_say_removed(extra, path):
    with pytest.raises(ConfigError, match="removed in DeepSpeed") as err:
        load_config(cfg(**extra))
    assert err.value.path.startswith(path)


def test_zero_keys_gas_lab_lacks_are_not_supported():
    with pytest.raises(NotImplementedInGasLab, match="zero_optimization.sub_group_size"):
        load_config(cfg(zero_optimization={"stage": 1, "sub_group_size": 10}))


# DeepSpeed's do-nothing values of keys gas_lab does not implement: accepted (a config copied
# from DeepSpeed's docs often spells out the defaults); the value that does something: refused.
OFF = [
    dict(zero_optimization={"stage": 1, "cpu_offload": False}),
    dict(zero_optimization={"stage": 0, "zero_hpz_partition_size": 1}),
    dict(zero_optimization={"stage": 1, "zero_quantized_weights": False}),
    dict(zero_optimization={"stage": 1, "stage3_param_persistence_threshold": 1e4}),
    dict(zero_optimization={"stage": 2, "stage3_max_live_parameters": 3, "sub_group_size": 1e9}),
    dict(torch_autocast={"enabled": False}),
    dict(torch_autocast={}),
    dict(wandb={"enabled": False, "project": "x"}),
    dict(memory_breakdown=False, dump_state=False, sequence_parallel_size=1),
    dict(zero_force_ds_cpu_optimizer=True, log_level="info"),
]
ON = [
    (dict(zero_optimization={"stage": 1, "cpu_offload": True}), "zero_optimization.cpu_offload"),
    (dict(zero_optimization={"stage": 1, "zero_hpz_partition_size": 2}), "zero_hpz_partition"),
    (dict(zero_optimization={"stage": 1, "zero_quantized_weights": True}), "zero_quantized"),
    (dict(torch_autocast={"enabled": True}), "torch_autocast.enabled"),
    (dict(memory_breakdown=True), "memory_breakdown"),
    (dict(sequence_parallel_size=2), "sequence_parallel_size"),
]


@pytest.mark.parametrize("extra", OFF)
def test_deepspeed_keys_at_their_do_nothing_value_are_accepted(extra):
    from deepspeed.runtime.config import DeepSpeedConfig

    DeepSpeedConfig(cfg(**extra))  # DeepSpeed takes them too
    assert load_config(cfg(**extra)).train_micro_batch_size_per_gpu == 2


@pytest.mark.parametrize("extra, path", ON)
def test_deepspeed_keys_that_ask_for_a_feature_are_refused_naming_it(extra, path):
    with pytest.raises(NotImplementedInGasLab, match=f"{path}.*not supported by gas_lab"):
        load_config(cfg(**extra))


def test_do_nothing_values_are_deepspeeds_defaults():
    import deepspeed.runtime.constants as constants
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = {f.alias or name: f for name, f in DeepSpeedZeroConfig.model_fields.items()}
    fields |= dict(DeepSpeedZeroConfig.model_fields)
    for key, default in deepspeed_keys.ZERO_DEFAULTS.items():
        assert fields[key].default == default, key
    for key in deepspeed_keys.ZERO_STAGE3_ONLY:  # their names or aliases are ZeRO-3's
        name = next(n for n, f in DeepSpeedZeroConfig.model_fields.items() if key in (n, f.alias))
        assert "stage3" in key or fields[name].alias.startswith("stage3"), key
    for key, default in deepspeed_keys.DEFAULTS.items():
        if key == "sequence_parallel_size":  # read as config.get(..., 1) where it is used
            assert default == 1
            continue
        name = {"use_data_before_expert_parallelism": "USE_DATA_BEFORE_EXPERT_PARALLEL"}.get(
            key, key.upper()
        )
        assert getattr(constants, name + "_DEFAULT") == default, key
    assert set(deepspeed_keys.DEFAULTS) <= deepspeed_keys.NOT_SUPPORTED
    assert set(deepspeed_keys.ZERO_DEFAULTS) | deepspeed_keys.ZERO_STAGE3_ONLY <= (
        deepspeed_keys.ZERO_NOT_SUPPORTED
    )


def test_amp_is_refused_even_null():
    with pytest.raises(RejectedCombination, match="amp"):
        load_config(cfg(amp=None))


@pytest.mark.parametrize(
    "extra, path",
    [
        (dict(fp16={"enabled": False, "loss_scal": 0}), "fp16.loss_scal"),
        (dict(bf16={"enabled": False, "foo": 1}), "bf16.foo"),
        (dict(compile={"deepcompile": False, "foo": 1}), "compile.foo"),
        (dict(zero_optimization={"offload_optimizer": {"foo": 1}}), "offload_optimizer.foo"),
        (dict(zero_optimization={"offload_param": {"device": None}}), "offload_param.device"),
        (dict(world_size=8), "world_size"),
        (dict(steps_per_print=0), "steps_per_print"),
        (dict(zero_optimization={"reduce_bucket_size": True}), "reduce_bucket_size"),
        (dict(zero_optimization={"reduce_bucket_size": "2"}), "reduce_bucket_size"),
        (dict(zero_optimization={"reduce_bucket_size": 1e30}), "reduce_bucket_size"),
        (dict(zero_optimization={"reduce_bucket_size": 2.5}), "reduce_bucket_size"),
        (dict(zero_optimization={"reduce_bucket_size": 0}), "reduce_bucket_size"),
        (dict(zero_optimization={"stage": 1, "allgather_bucket_size": 3}), "allgather_bucket"),
        (dict(zero_optimization={"allgather_bucket_size": -1}), "allgather_bucket_size"),
        (dict(zero_optimization={"compute_grad_norm": False}), "compute_grad_norm"),
        (dict(zero_optimization={"stage": 1, "compute_grad_norm": False}), "compute_grad_norm"),
        (dict(gradient_predivide_factor=0), "gradient_predivide_factor"),
        (dict(prescale_gradients=1), "prescale_gradients"),
    ],
)
def test_values_deepspeed_refuses_or_crashes_on_name_the_key(extra, path):
    with pytest.raises(ConfigError) as err:
        load_config(cfg(**extra))
    assert path in err.value.path, err.value


def test_error_types_are_deepspeeds():
    with pytest.raises(ZeroDivisionError):  # DeepSpeed: at the first update
        load_config(cfg(steps_per_print=0))
    with pytest.raises(AssertionError, match="even"):
        load_config(cfg(zero_optimization={"stage": 1, "allgather_bucket_size": 3}))


@pytest.mark.parametrize(
    "extra",
    [
        dict(zero_optimization={"stage": 0, "allgather_bucket_size": 3}),  # only stage 1 checks
        dict(zero_optimization={"stage": 1, "allgather_bucket_size": 0}),
        dict(zero_optimization={"stage": 1, "compute_grad_norm": False}, gradient_clipping=0),
        dict(gradient_clipping=-1),  # DeepSpeed: no clipping
        dict(steps_per_print=None, wall_clock_breakdown=True),
        dict(fp16={"enabled": False, "loss_scale": 0, "initial_scale_power": 12}),
        dict(zero_optimization={"offload_optimizer": {"device": "none", "pin_memory": True}}),
        dict(prescale_gradients=True, gradient_predivide_factor=2.0),
    ],
)
def test_values_deepspeed_accepts_load(extra):
    load_config(cfg(**extra))


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


@pytest.mark.parametrize("reader", ["hjson", "json"])
def test_a_config_that_is_not_json_is_a_config_error_whichever_reader_reads_it(
    tmp_path, monkeypatch, reader
):
    """Without hjson (``sys.modules["hjson"] = None`` makes its import fail), json reads the
    file; its syntax error must not escape as a bare JSONDecodeError."""
    from gas_lab.deepspeed_compat.config import read_config

    if reader == "json":
        monkeypatch.setitem(sys.modules, "hjson", None)
    else:
        pytest.importorskip("hjson")
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2,, }')
    with pytest.raises(ConfigError, match="is not JSON"):
        read_config(str(path))
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(ConfigError, match="appears twice"):
        read_config(str(path))
