"""What DeepSpeed accepts but gas_lab does not teach: each entry raises
:class:`~gas_lab.errors.NotImplementedInGasLab`, which points you to ``deepspeed.initialize``.
"""

from __future__ import annotations

from gas_lab.rules.rule import OutOfScope, Situation, zero_stage


def _fp32_throughout(s: Situation) -> bool:
    """fp32 weights, fp32 accumulation, fp32 communication."""
    dtypes = (s.config.model_dtype, s.config.grad_accum_dtype)
    return all(str(d) == "torch.float32" for d in dtypes) and (
        s.config.communication_data_type in (None, "fp32")
    )


OUT_OF_SCOPE: list[OutOfScope] = [
    OutOfScope(
        "zero_stage_3", "initialize", "zero_optimization.stage 3",
        "ZeRO-3 partitions the parameters too (lesson 09 observes it on DeepSpeed); use "
        "deepspeed.initialize for it.",
        lambda s: zero_stage(s) >= 3,
    ),
    OutOfScope(
        "zero_stage_2_precision", "initialize",
        "ZeRO stage 2 with bf16 weights, or gradients accumulated or communicated below fp32",
        "gas_lab's ZeRO-2 (lesson 09) is fp32 from end to end; use deepspeed.initialize for "
        "mixed precision at stage 2.",
        lambda s: zero_stage(s) == 2 and not _fp32_throughout(s),
    ),
    OutOfScope(
        "zero_stage_2_variants", "initialize",
        "ZeRO stage 2 with contiguous_gradients or reduce_scatter or allgather_partitions false, "
        "or round_robin_gradients true",
        "gas_lab's ZeRO-2 (lesson 09) is DeepSpeed's default reduction (one bucket, all-reduce "
        "of packed slices, one all-gather); use deepspeed.initialize for its variants.",
        lambda s: zero_stage(s) == 2 and (
            not s.config.zero_optimization.contiguous_gradients
            or not s.config.zero_optimization.reduce_scatter
            or not s.config.zero_optimization.allgather_partitions
            or s.config.zero_optimization.round_robin_gradients
        ),
    ),
    OutOfScope(
        "offload", "initialize", "zero_optimization.offload_optimizer / offload_param",
        "CPU/NVMe offload is DeepSpeed-only; use deepspeed.initialize.",
        lambda s: s.config.zero_optimization.offloads(),
    ),
    OutOfScope(
        "pipeline", "initialize", "a PipelineModule model",
        "Pipeline parallelism is DeepSpeed-only (deepspeed.pipe); use deepspeed.initialize.",
        lambda s: s.pipeline,
    ),
    OutOfScope(
        "deepcompile", "initialize", "compile.deepcompile true",
        "DeepCompile is DeepSpeed-only; use deepspeed.initialize.",
        lambda s: s.config.compile.deepcompile,
    ),
    OutOfScope(
        "fp16", "initialize", "fp16.enabled",
        "fp16 (with its loss scaling) is DeepSpeed-only, and refused on CPUs without fp16; "
        "gas_lab has bf16. Use deepspeed.initialize.",
        lambda s: s.config.fp16.enabled,
    ),
    OutOfScope(
        "low_precision_accumulation", "initialize",
        "ZeRO stage 1 with grad_accum_dtype below the model's (fp32 model + bf16/fp16/int8, or "
        "bf16 model + fp16/int8)",
        "DeepSpeed accumulates in a separate lower-precision grad_accum buffer there; gas_lab "
        "teaches accumulation in the model's dtype or fp32. Use deepspeed.initialize.",
        lambda s: zero_stage(s) == 1 and not s.config.fp16.enabled
        and s.config.grad_accum_dtype != s.config.model_dtype
        and s.config.grad_accum_dtype.itemsize < 4,  # not fp32
    ),
    OutOfScope(
        "bf16_master_weights", "initialize",
        "bf16.bf16_master_weights_and_grads or bf16.bf16_optimizer_states",
        "bf16 master weights need ZeRO-Offload with DeepSpeedCPUAdam (DeepSpeed refuses them "
        "otherwise); use deepspeed.initialize.",
        lambda s: s.config.bf16.bf16_master_weights_and_grads or s.config.bf16.bf16_optimizer_states,
    ),
]  # fmt: skip
