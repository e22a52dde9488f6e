"""The DeepSpeed 0.19.8 config keys gas_lab does not teach, and what it does with each.

A config copied from DeepSpeed's docs carries keys this course leaves out. gas_lab never
drops one silently, and never refuses one that asks for nothing:

* **sections gas_lab validates but does not run** (:class:`Fp16Section`, :class:`CompileSection`,
  the two offload blocks): every DeepSpeed key is accepted with DeepSpeed's type, and does
  nothing while the feature is off; switching the feature on is refused as out of scope
  (:mod:`gas_lab.rules.refusals`). An unknown key inside them is an error, as in DeepSpeed.
* **features switched off** (:data:`SWITCHED`, :class:`SwitchedOffKeys`): a block such as
  ``"torch_autocast": {"enabled": false}`` is accepted while ``enabled`` is false (DeepSpeed's
  default); ``true`` is refused, naming ``<key>.enabled``.
* **keys DeepSpeed reads that gas_lab does not implement** (:data:`NOT_SUPPORTED`,
  :data:`ZERO_NOT_SUPPORTED`): accepted at DeepSpeed's default, the value that does nothing
  (:data:`DEFAULTS`, :data:`ZERO_DEFAULTS`; ``"cpu_offload": false``, ``"zero_hpz_partition_size":
  1``), and the ZeRO-3 tuning keys (:data:`ZERO_STAGE3_ONLY`) at any value below stage 3, where
  DeepSpeed does not read them. Any other value is refused with "not supported by gas_lab"
  (:class:`~gas_lab.errors.NotImplementedInGasLab`), not "check the spelling"; so is a settings
  block of a feature gas_lab does not have (``activation_checkpointing``, ``aio``, ...).
* **keys DeepSpeed removed** (:data:`REMOVED`): DeepSpeed refuses them by their presence, any
  value, ``null`` included; so does gas_lab (``amp``: by the rule that explains why).

The lists come from a trace of the keys ``deepspeed.initialize`` and one training step read
at ZeRO stages 0 and 1, and from DeepSpeed's own section models and constants;
``tests/test_config.py`` checks them against both.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gas_lab.errors import ConfigError, NotImplementedInGasLab

# Top-level blocks of a feature gas_lab does not have, switched by "enabled" (default false).
SWITCHED = {
    "autotuning": "DeepSpeed's autotuner",
    "bfloat16": "bf16 under its old name: write the key 'bf16'",
    "comet": "the Comet monitor",
    "comms_logger": "DeepSpeed's communication logger",
    "csv_monitor": "the CSV monitor",
    "data_efficiency": "DeepSpeed's data efficiency library",
    "flops_profiler": "DeepSpeed's flops profiler",
    "hybrid_engine": "DeepSpeed's hybrid (RLHF) engine",
    "tensorboard": "the TensorBoard monitor",
    "torch_autocast": "torch.autocast mixed precision (gas_lab has bf16)",
    "wandb": "the Weights & Biases monitor",
}
# Top-level keys DeepSpeed reads that gas_lab does not implement: accepted at DEFAULTS only.
NOT_SUPPORTED = frozenset(
    """
    activation_checkpointing aio checkpoint datastates_ckpt disable_allgather disable_python_gc
    dump_state expert_parallel memory_breakdown seq_parallel_communication_data_type
    sequence_parallel_size tensor_parallel timers use_data_before_expert_parallelism
    vocabulary_size weight_quantization zero_force_ds_cpu_optimizer
""".split()
)
# DeepSpeed 0.19.8's defaults (deepspeed/runtime/constants.py): the values that do nothing.
# Keys not listed are settings blocks of a feature gas_lab lacks: refused at any value.
DEFAULTS: dict[str, Any] = {
    "disable_allgather": False,
    "disable_python_gc": False,
    "dump_state": False,
    "memory_breakdown": False,
    "seq_parallel_communication_data_type": "fp32",
    "sequence_parallel_size": 1,
    "use_data_before_expert_parallelism": False,
    "vocabulary_size": None,
    "zero_force_ds_cpu_optimizer": True,  # read only with a CPU optimizer offload
}
# Keys of zero_optimization DeepSpeed reads that gas_lab does not implement (stage 2/3 tuning,
# checkpoint loading, quantized and hierarchical ZeRO, ...).
ZERO_NOT_SUPPORTED = frozenset(
    """
    load_from_fp32_weights elastic_checkpoint zenflow sub_group_size cpu_offload_param
    cpu_offload_use_pin_memory cpu_offload stage3_prefetch_bucket_size prefetch_bucket_size
    stage3_param_persistence_threshold param_persistence_threshold
    stage3_model_persistence_threshold model_persistence_threshold stage3_max_live_parameters
    max_live_parameters stage3_max_reuse_distance max_reuse_distance
    stage3_gather_16bit_weights_on_model_save gather_16bit_weights_on_model_save
    stage3_module_granularity_threshold module_granularity_threshold
    stage3_use_all_reduce_for_fetch_params use_all_reduce_for_fetch_params
    stage3_allgather_sequential allgather_sequential stage3_gather_fp16_weights_on_model_save
    ignore_unused_parameters legacy_stage1 parameter_alignment zero_hpz_partition_size
    zero_quantized_weights zero_quantized_nontrainable_weights zero_quantized_gradients
    memory_efficient_linear pipeline_loading_checkpoint override_module_apply
    log_trace_cache_warnings enable_sanity_checks save_muon_momentum_buffer_in_memory leaf_module
""".split()
)
# ZeRO-3's tuning keys (and their names without "stage3_"): DeepSpeed reads them at stage 3
# only, so below it any value does nothing.
ZERO_STAGE3_ONLY = frozenset(
    """
    stage3_prefetch_bucket_size prefetch_bucket_size stage3_param_persistence_threshold
    param_persistence_threshold stage3_model_persistence_threshold model_persistence_threshold
    stage3_max_live_parameters max_live_parameters stage3_max_reuse_distance max_reuse_distance
    stage3_gather_16bit_weights_on_model_save gather_16bit_weights_on_model_save
    stage3_module_granularity_threshold module_granularity_threshold
    stage3_use_all_reduce_for_fetch_params use_all_reduce_for_fetch_params
    stage3_allgather_sequential allgather_sequential stage3_gather_fp16_weights_on_model_save
""".split()
)
# DeepSpeedZeroConfig's defaults for the others (None: the key may also be false).
ZERO_DEFAULTS: dict[str, Any] = {
    "load_from_fp32_weights": True,
    "elastic_checkpoint": False,
    "zenflow": None,
    "sub_group_size": 1_000_000_000,
    "cpu_offload_param": None,
    "cpu_offload_use_pin_memory": None,
    "cpu_offload": None,
    "ignore_unused_parameters": True,
    "legacy_stage1": False,
    "parameter_alignment": False,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "memory_efficient_linear": True,
    "pipeline_loading_checkpoint": False,
    "override_module_apply": True,
    "log_trace_cache_warnings": False,
    "enable_sanity_checks": False,
    "save_muon_momentum_buffer_in_memory": False,
}
# Removed in DeepSpeed 0.19.8 (refused by presence). "amp" is refused by its rule instead.
REMOVED = frozenset(
    """
    compression_training curriculum_learning eigenvalue elasticity graph_harvesting nebula
    progressive_layer_drop quantize_training sparse_attention sparse_gradients
""".split()
)
ZERO_REMOVED = frozenset(
    {"mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"}
)


def _does_nothing(value, default) -> bool:
    # A bool default of None (DeepSpeed: "not set") is off as false too; 1 is not True here,
    # while 1e9 is 1_000_000_000 (DeepSpeed configs write sizes so).
    if default is None or isinstance(default, bool):
        return value is default or (default is None and value is False)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default
    return value == default


def check_known(config: dict) -> dict:
    """Refuse DeepSpeed keys gas_lab does not implement, or that DeepSpeed removed; return
    ``config`` without the ones set to what does nothing (accepted, as DeepSpeed would read
    them: not at all)."""
    zero = config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    stage = zero.get("stage", 0)
    below_3 = isinstance(stage, int) and stage < 3
    for key, value in config.items():
        _refuse_removed("", key, REMOVED)
        if key in SWITCHED and isinstance(value, dict) and value.get("enabled", False):
            raise NotImplementedInGasLab(
                f"config key '{key}.enabled': {value['enabled']!r} switches on "
                f"{SWITCHED[key]}, not supported by gas_lab; set it false, or use "
                "deepspeed.initialize"
            )
        if key in NOT_SUPPORTED and not (key in DEFAULTS and _does_nothing(value, DEFAULTS[key])):
            raise NotImplementedInGasLab(_not_supported(key, value, DEFAULTS))
    for key, value in zero.items():
        _refuse_removed("zero_optimization.", key, ZERO_REMOVED)
        if (
            key in ZERO_NOT_SUPPORTED
            and not (key in ZERO_STAGE3_ONLY and below_3)
            and not (key in ZERO_DEFAULTS and _does_nothing(value, ZERO_DEFAULTS[key]))
        ):
            raise NotImplementedInGasLab(
                _not_supported(f"zero_optimization.{key}", value, ZERO_DEFAULTS, key)
            )
    out = {k: v for k, v in config.items() if k not in NOT_SUPPORTED}
    if "zero_optimization" in config and isinstance(config["zero_optimization"], dict):
        out["zero_optimization"] = {k: v for k, v in zero.items() if k not in ZERO_NOT_SUPPORTED}
    return out


def _refuse_removed(prefix: str, key: str, removed: frozenset) -> None:
    if key in removed:
        raise ConfigError(
            prefix + key,
            "removed in DeepSpeed 0.19.8, which refuses the key "
            "whatever its value (DeepSpeedConfigError); remove it",
        )


def _not_supported(path: str, value, defaults: dict, key: str | None = None) -> str:
    key = key or path
    if key in defaults:
        default = defaults[key]
        what = "false or null" if default is None else json.dumps(default)
        return (
            f"config key '{path}': {value!r} asks for a DeepSpeed feature not supported by "
            f"gas_lab, which takes only the value that does nothing ({what}, DeepSpeed's "
            "default); remove the key, or use deepspeed.initialize"
        )
    return (
        f"config key '{path}': a DeepSpeed key not supported by gas_lab; remove it, or use "
        "deepspeed.initialize"
    )


class SwitchedOffKeys(BaseModel):
    """The :data:`SWITCHED` blocks, as fields of the config: accepted while switched off
    (:func:`check_known` refuses ``enabled: true``), and then nothing reads them."""

    autotuning: dict | None = None
    bfloat16: dict | None = None
    comet: dict | None = None
    comms_logger: dict | None = None
    csv_monitor: dict | None = None
    data_efficiency: dict | None = None
    flops_profiler: dict | None = None
    hybrid_engine: dict | None = None
    tensorboard: dict | None = None
    torch_autocast: dict | None = None
    wandb: dict | None = None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Fp16Section(_Strict):
    """``fp16``: only ``enabled`` matters, and true is refused (lesson 07 has a loss scaler of its
    own, :mod:`gas_lab.deepspeed_compat.loss_scaling`); DeepSpeed's other keys are accepted and unused."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0, ge=0, allow_inf_nan=False)  # DeepSpeed checks these two
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: int = 1
    fp16_master_weights_and_grads: bool = False


class CompileSection(_Strict):
    """``compile``: ``deepcompile`` true is refused; DeepCompile's tuning keys are unused."""

    deepcompile: bool = False
    autoep_non_moe: bool = False
    free_activation: bool = False
    free_activation_threshold: int = 10 * 1024 * 1024
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[str] | None = None


class _Offload(_Strict):
    """An offload block: ``device`` other than "none" is refused (DeepSpeed-only); the tuning
    keys are accepted and unused, as in DeepSpeed without offload."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True


class OffloadParamSection(_Offload):
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)


class OffloadOptimizerSection(_Offload):
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)
