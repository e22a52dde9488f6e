"""The refusals DeepSpeed makes at ``initialize``: combinations of config keys (and a pipeline
model) that a boundary owned by the caller, or DeepSpeed's own build, cannot honour.

Each rule's ``order`` says where DeepSpeed checks it (the hundreds: 1xx while its config is
parsed, 2xx in its engine's sanity checks, 3xx while it builds the optimizer and then checks
it); :mod:`gas_lab.rules.refusals` gathers them with the others in that order.
"""

from __future__ import annotations

from gas_lab.rules.rule import MGA, UNMANAGED, Example, Rule, is_unmanaged, zero_stage

CONFIG_REFUSALS: list[Rule] = [
    Rule(
        "apex_amp", "initialize", "initialize", ("amp",),
        'an "amp" block, even {"enabled": false}, managed or not',
        "Apex AMP was removed; DeepSpeed refuses the key itself. Before, it refused amp with "
        "unmanaged accumulation: Apex unscales the accumulated gradients in the backward() of "
        "the boundary micro-batch (delay_unscale on all others). Use bf16/fp16 instead.",
        "unmanaged, no backward() is the boundary, so gradients are never unscaled: every "
        "update is loss-scale times too large and overflows are never detected (gas_lab's "
        "model of Apex, read from its source: appendix A4).",
        "DeepSpeedConfigError", "NVIDIA Apex AMP integration has been removed.",
        Example(config={**UNMANAGED, "amp": {"enabled": True}}),
        lambda s: s.config.amp is not None,
        order=110,
    ),
    Rule(
        "fp16_on_cpu", "initialize", "initialize", ("fp16.enabled",),
        "fp16 on a device without fp16 support (this CPU; a GPU accepts it)",
        "DeepSpeed asks the accelerator whether it supports fp16. Not a boundary rule: a "
        "device limit.",
        "nothing silent: it is a hardware limit.",
        "ValueError", "Type fp16 is not supported on your device.",
        Example(config={"fp16": {"enabled": True}}),
        lambda s: s.config.fp16.enabled,
        gas_lab="out of scope at initialize (gas_lab has bf16, not fp16)",
        order=210,
    ),
    Rule(
        "max_grad_norm_param", "initialize", "initialize", ("optimizer.params.max_grad_norm",),
        "max_grad_norm inside the optimizer params",
        "DeepSpeed clips gradients itself, once per optimizer step, from the top-level "
        "gradient_clipping key (default 1.0), and takes no other spelling of it.",
        "two ways to ask for clipping that do different things: torch's optimizers (SGD, "
        "AdamW) raise TypeError on a max_grad_norm argument, while DeepSpeed's FusedLamb takes "
        "it and clips again inside its own step, after gradient_clipping.",
        "ValueError", "'max_grad_norm' is not supported as an optimizer parameter",
        Example(config={"optimizer": {"type": "SGD", "params": {"lr": 0.1, "max_grad_norm": 1.0}}}),
        lambda s: s.config.optimizer is not None
        and s.config.optimizer.params.get("max_grad_norm") is not None,
        order=310,
    ),
    Rule(
        "untested_zero_optimizer", "initialize", "initialize",
        ("zero_optimization.stage>=1", "optimizer.type", "zero_allow_untested_optimizer"),
        "ZeRO stage >= 1 with SGD and zero_allow_untested_optimizer false",
        "ZeRO re-points the optimizer at flat shards of the parameters; DeepSpeed only vouches "
        "for the Adam family there, so anything else needs an explicit opt-in.",
        "an optimizer that keeps per-tensor state (shapes, norms) would silently see shards.",
        "AssertionError", "You are using an untested ZeRO Optimizer.",
        Example(config={"zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {}}}),
        lambda s: zero_stage(s) >= 1 and s.config.optimizer is not None
        and s.config.optimizer.type == "SGD" and not s.config.zero_allow_untested_optimizer,
        order=320,
    ),
    Rule(
        "unmanaged_overlap_comm", "initialize", "initialize",
        (MGA, "zero_optimization.overlap_comm"),
        "unmanaged, ZeRO stage 0/1, overlap_comm true",
        "overlap_comm reduces from hooks that fire during backward(), and only in the backward() "
        "of the boundary micro-batch; step() then trusts that they did. Unmanaged, the boundary "
        "exists only inside step(). (The message says 'only with ZeRO stage 2': stage 3 is "
        "accepted too; at stage 0, which ignores overlap_comm, it is refused all the same.)",
        "ZeRO-1 updates each rank's partition from that rank's local, un-averaged gradient; the "
        "all-gather then makes every rank agree on the wrong weights.",
        "AssertionError", "managed_gradient_accumulation=False supports ZeRO overlap_comm only "
        "with ZeRO stage 2",
        Example(config={**UNMANAGED, "zero_optimization": {"overlap_comm": True}}),
        lambda s: is_unmanaged(s) and zero_stage(s) < 2 and s.config.zero_optimization.overlap,
        order=220,
    ),
    Rule(
        "unmanaged_pipeline", "initialize", "initialize", (MGA, "PipelineModule"),
        "unmanaged with a pipeline-parallel model",
        "The pipeline engine runs its own schedule of gradient_accumulation_steps micro-batches "
        "inside train_batch(); its backward() and step() cannot be called. The schedule owns "
        "the boundary, so the caller cannot.",
        "your loop's number of micro-batches would be ignored: every step would run exactly "
        "gradient_accumulation_steps of them.",
        "AssertionError", "managed_gradient_accumulation=False is not supported with pipeline "
        "parallelism",
        Example(config=UNMANAGED, pipeline=True),
        lambda s: is_unmanaged(s) and s.pipeline,
        order=230,
    ),
    Rule(
        "unmanaged_deepcompile", "initialize", "initialize", (MGA, "compile.deepcompile"),
        "unmanaged with DeepCompile",
        "DeepCompile (active at ZeRO 1-3; stage 0 falls back to torch.compile) compiles the "
        "gradient reduction into the backward graph and switches the engine's own off; at "
        "ZeRO-1 a backward() that is not the boundary empties the optimizer's averaged "
        "gradients. Unmanaged, no backward() is the boundary.",
        "not silent: at ZeRO-1, step() finds no averaged gradients and raises KeyError, in the "
        "middle of training (gas_lab's model, read from DeepSpeed's source: its CPU "
        "accelerator has no DeepCompile op; appendix A4). At stage 0 nothing: DeepCompile "
        "falls back to torch.compile.",
        "AssertionError", "managed_gradient_accumulation=False is not supported with DeepCompile",
        Example(config={**UNMANAGED, "compile": {"deepcompile": True}}),
        lambda s: is_unmanaged(s) and s.config.compile.deepcompile,
        order=240,
    ),
    # -- lesson 08: sum or mean, and the accumulation dtype (gas_lab/deepspeed_compat/precision.py) -----------
    Rule(
        "sum_stage3", "initialize", "initialize",
        ("gradient_allreduce_op=sum", "zero_optimization.stage=3"),
        "gradient_allreduce_op 'sum' at ZeRO stage 3",
        "ZeRO-3 reduce-scatters partitioned gradients with its own averaging; DeepSpeed 0.19.8 "
        "implements the plain sum for stages 0, 1 and 2 only.",
        "nothing silent: DeepSpeed refuses before building anything.",
        "ValueError", "gradient_allreduce_op='sum' is not supported with ZeRO stage 3",
        Example(config={"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}),
        lambda s: s.config.gradient_allreduce_op == "sum" and zero_stage(s) == 3,
        order=120,
    ),
    Rule(
        "sum_deepcompile", "initialize", "initialize",
        ("gradient_allreduce_op=sum", "compile.deepcompile"),
        "gradient_allreduce_op 'sum' with DeepCompile",
        "DeepCompile compiles its own (averaging) reduction into the backward graph.",
        "nothing silent: DeepSpeed refuses before building anything.",
        "ValueError", "gradient_allreduce_op='sum' is not supported with DeepCompile",
        Example(config={"gradient_allreduce_op": "sum", "compile": {"deepcompile": True}}),
        lambda s: s.config.gradient_allreduce_op == "sum" and s.config.compile.deepcompile,
        order=130,
    ),
    Rule(
        "grad_accum_dtype_stage0", "initialize", "initialize",
        ("zero_optimization.stage=0", "data_types.grad_accum_dtype"),
        "ZeRO stage 0 with grad_accum_dtype unlike the model's dtype (e.g. bf16 + fp32)",
        "At stage 0 the gradients accumulate in the parameters' own .grad, so they can only be "
        "in the model's dtype. A separate fp32 accumulation exists only in DeepSpeed's ZeRO "
        "optimizers: BF16_Optimizer at stage 1, DeepSpeedZeroOptimizer's fp32 gradient "
        "partitions at stage 2 (use_separate_grad_accum), and stage 3's gradient partitions, "
        "kept in grad_accum_dtype.",
        "you would believe the bf16 gradients add up in fp32 while they add up in bf16: an "
        "error that grows with the number of micro-batches.",
        "NotImplementedError", "unsupported mix of model_dtype=",
        Example(config={"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}),
        lambda s: zero_stage(s) == 0 and not s.config.fp16.enabled
        and s.config.model_dtype != s.config.grad_accum_dtype,
        order=330,
    ),
    # -- lessons 05 and 08: where the mean divides (gas_lab/measure/mean_division.py) --------
    Rule(
        "predivide_stage2", "initialize", "initialize",
        ("zero_optimization.stage=2", "gradient_predivide_factor"),
        "ZeRO stage 2 averaging with reduce_scatter (the default), gradient_predivide_factor "
        "other than 1.0",
        "ZeRO-2's default reduction divides every bucket by the world size before the sum, in "
        "one step with no factor in it; only the plain all-reduce of reduce_scatter false "
        "splits the division around the sum by gradient_predivide_factor. DeepSpeed's ZeRO "
        "optimizer refuses the key where it would not be read.",
        "a factor you set, silently ignored: all of the division would happen before the "
        "sum, whatever the factor.",
        "AssertionError", "gradient_predivide_factor != 1.0 is not yet supported with ZeRO-2 "
        "with reduce scatter enabled",
        Example(config={"zero_optimization": {"stage": 2}, "gradient_predivide_factor": 2.0}),
        lambda s: zero_stage(s) == 2 and s.config.zero_optimization.reduce_scatter
        and s.config.gradient_allreduce_op == "mean" and s.config.gradient_predivide_factor != 1.0,
        order=340,
    ),
    Rule(
        "prescale_stage2", "initialize", "initialize",
        ("zero_optimization.stage=2", "prescale_gradients"),
        "ZeRO stage 2 averaging with reduce_scatter (the default), prescale_gradients true",
        "prescale_gradients asks for the mean's division before the sum instead of after it. "
        "ZeRO-2's default reduction divides every bucket before the sum anyway, in one place "
        "with no switch, and DeepSpeed's ZeRO optimizer refuses the key there (after the "
        "predivide check). Stage 0 and reduce_scatter false read it; stage 1's default "
        "reduction, which divides first too, accepts it unchecked.",
        "a key that would be read nowhere: the same run with it or without it, while the "
        "config says the division was chosen.",
        "AssertionError", "pre-scale gradients is not yet supported with ZeRO-2 with reduce "
        "scatter enabled",
        Example(config={"zero_optimization": {"stage": 2}, "prescale_gradients": True}),
        lambda s: zero_stage(s) == 2 and s.config.zero_optimization.reduce_scatter
        and s.config.gradient_allreduce_op == "mean" and s.config.prescale_gradients,
        order=350,
    ),
]  # fmt: skip
