"""The DeepSpeed 0.19.8 config keys gas_lab does not teach, and what it does with each.

A config copied from DeepSpeed's docs carries keys this course leaves out. gas_lab never
drops one silently:

* **sections gas_lab validates but does not run** (:class:`Fp16Section`, :class:`CompileSection`,
  the two offload blocks): every DeepSpeed key is accepted with DeepSpeed's type, and does
  nothing while the feature is off; switching the feature on is refused as out of scope
  (:mod:`gas_lab.rules.refusals`). An unknown key inside them is an error, as in DeepSpeed.
* **keys DeepSpeed reads that gas_lab does not implement** (:data:`NOT_SUPPORTED`,
  :data:`ZERO_NOT_SUPPORTED`): refused with "not supported by gas_lab"
  (:class:`~gas_lab.errors.NotImplementedInGasLab`), not "check the spelling".
* **keys DeepSpeed removed** (:data:`REMOVED`): DeepSpeed refuses them by their presence, any
  value, ``null`` included; so does gas_lab (``amp``: by the rule that explains why).

The lists come from a trace of the keys ``deepspeed.initialize`` and one training step read
at ZeRO stages 0 and 1, and from DeepSpeed's own section models; ``tests/test_config.py``
checks them against both.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gas_lab.errors import ConfigError, NotImplementedInGasLab

# Top-level keys DeepSpeed reads that gas_lab does not implement.
NOT_SUPPORTED = frozenset(
    """
    activation_checkpointing aio autotuning bfloat16 checkpoint comet comms_logger csv_monitor
    data_efficiency datastates_ckpt disable_allgather disable_python_gc dump_state expert_parallel
    flops_profiler hybrid_engine log_level memory_breakdown seq_parallel_communication_data_type
    sequence_parallel_size tensor_parallel tensorboard timers torch_autocast
    use_data_before_expert_parallelism vocabulary_size wandb weight_quantization
    zero_force_ds_cpu_optimizer
""".split()
)
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


def check_known(config: dict, zero: object) -> None:
    """Refuse DeepSpeed keys gas_lab does not implement, or that DeepSpeed removed."""
    for prefix, keys, not_supported, removed in (
        ("", config, NOT_SUPPORTED, REMOVED),
        ("zero_optimization.", zero if isinstance(zero, dict) else {}, ZERO_NOT_SUPPORTED,
         ZERO_REMOVED),
    ):  # fmt: skip
        for key in keys:
            if key in removed:
                raise ConfigError(prefix + key, "removed in DeepSpeed 0.19.8, which refuses the "
                                  "key whatever its value (DeepSpeedConfigError); remove it")  # fmt: skip
            if key in not_supported:
                raise NotImplementedInGasLab(
                    f"config key '{prefix}{key}': a DeepSpeed key not supported by gas_lab; "
                    "remove it, or use deepspeed.initialize"
                )


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
