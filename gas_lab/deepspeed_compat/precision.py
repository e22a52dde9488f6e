"""bf16 and the accumulation dtype at ZeRO stage 0 and 1, routed as DeepSpeed 0.19.8 routes them.

Three dtypes decide where a bf16 run rounds, and DeepSpeed derives all three from the config:

* the **model** dtype: bf16 when ``"bf16": {"enabled": true}`` (parameters are cast, buffers
  stay fp32), else fp32. The optimizer always steps on fp32 *master* copies of bf16 weights.
* the **accumulation** dtype, ``data_types.grad_accum_dtype``: where micro-batch gradients add
  up. Absent, it is the model's dtype, so a bf16 model accumulates in bf16 by default.
* the **communication** dtype, ``communication_data_type``: the dtype of the boundary
  all-reduce. Absent, it is bf16 when bf16 is on (even if accumulation is fp32), else fp32.

What DeepSpeed does with each combination (measured on the CPU accelerator, both modes alike):

========================  ===========================  ==================================
bf16, grad_accum_dtype    stage 0                      stage 1
========================  ===========================  ==================================
off, absent or fp32       the torch optimizer          ``DeepSpeedZeroOptimizer``
off, bf16 or fp16         NotImplementedError          accepted (a lower-precision buffer;
                                                       not in gas_lab)
on, absent or bf16        ``FP16_UnfusedOptimizer``:   ``DeepSpeedZeroOptimizer``: bf16
                          bf16 ``.grad``, fp32 master  ``.grad``, fp32 master shard
on, fp32                  NotImplementedError          ``BF16_Optimizer``: every
                                                       micro-batch's bf16 gradient added
                                                       into fp32 buffers
========================  ===========================  ==================================

fp16 is refused on this CPU (``ValueError: Type fp16 is not supported on your device.``) and is
out of gas_lab's scope everywhere. :func:`route` returns the :class:`Precision` of a config;
``gas_lab.deepspeed_compat.strategies`` hands it to the strategies, which follow it. A non-finite gradient norm *skips* the
update (``skipped_steps``) except at stage 0 in fp32, where DeepSpeed has no check and an inf
loss turns the weights into NaN. Taught in appendix A2 (``tutorials/A2_bf16_accumulation_dtype.ipynb``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, field_validator

# DeepSpeed's spellings (its DtypeEnum), for data_types.grad_accum_dtype.
DTYPE_NAMES = {
    **dict.fromkeys(("fp32", "float32", "float", "torch.float32"), torch.float32),
    **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), torch.bfloat16),
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), torch.float16),
    **dict.fromkeys(("int8", "torch.int8"), torch.int8),
}
COMM_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Bf16Config(BaseModel):
    """The ``bf16`` block, with DeepSpeed 0.19.8's keys and defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = False
    immediate_grad_update: bool = False  # BF16_Optimizer: move each grad to fp32 in a hook
    check_grad_overflow: bool = True  # skip an update whose gradient norm is inf/nan
    bf16_master_weights_and_grads: bool = False  # ZeRO offload only (refused without it)
    bf16_optimizer_states: bool = False


class DataTypesConfig(BaseModel):
    """The ``data_types`` block: only ``grad_accum_dtype`` (DeepSpeed's spellings)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    grad_accum_dtype: str | None = None

    @field_validator("grad_accum_dtype")
    @classmethod
    def _known(cls, value):
        if value is not None and value not in DTYPE_NAMES:
            raise ValueError(f"expected one of {sorted(DTYPE_NAMES)}")
        return value


def check_communication_data_type(value: str | None) -> str | None:
    """DeepSpeed's check: fp16, bf16 or fp32, any case (lower-cased here)."""
    if value is None:
        return None
    if value.lower() not in COMM_NAMES:
        raise ValueError(f"Supported data types: {list(COMM_NAMES)}. Got: {value}")
    return value.lower()


def model_dtype(cfg) -> torch.dtype:
    if cfg.fp16.enabled:
        return torch.float16
    return torch.bfloat16 if cfg.bf16.enabled else torch.float32


def grad_accum_dtype(cfg) -> torch.dtype:
    """``data_types.grad_accum_dtype``, or the model's dtype when absent (DeepSpeed's default)."""
    name = cfg.data_types.grad_accum_dtype
    return model_dtype(cfg) if name is None else DTYPE_NAMES[name]


def communication_dtype(cfg) -> torch.dtype:
    if cfg.communication_data_type is not None:
        return COMM_NAMES[cfg.communication_data_type]
    return model_dtype(cfg) if model_dtype(cfg) != torch.float32 else torch.float32


@dataclass(frozen=True)
class Precision:
    """Where a run rounds, and the DeepSpeed optimizer wrapper that rounds there."""

    model: torch.dtype
    accumulate: torch.dtype
    communicate: torch.dtype
    wrapper: str | None  # DeepSpeed's optimizer wrapper on this route (None: the bare optimizer)
    skip_nonfinite: bool  # a non-finite gradient norm skips the update
    immediate_grad_update: bool = False

    @property
    def fp32_master(self) -> bool:
        """The optimizer steps on fp32 copies of lower-precision weights."""
        return self.model != torch.float32

    @property
    def separate_buffer(self) -> bool:
        """Micro-batch gradients add up outside ``.grad``, in another dtype (BF16_Optimizer)."""
        return self.accumulate != self.model

    def grad_buffers(self, params) -> GradBuffers | None:
        """Where micro-batch gradients add up when not in ``.grad`` (:attr:`separate_buffer`)."""
        if not self.separate_buffer:
            return None
        return GradBuffers(params, self.accumulate, self.immediate_grad_update)

    def describe(self) -> str:
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        return (
            f"model {name[self.model]}, accumulate {name[self.accumulate]}, all-reduce "
            f"{name[self.communicate]}, wrapper {self.wrapper or 'none (torch optimizer)'}"
        )


def route(cfg) -> Precision:
    """The :class:`Precision` DeepSpeed 0.19.8 picks for an accepted config (stage 0 or 1).

    The refusals (stage 0 with ``grad_accum_dtype`` unlike the model; fp16) are rules in
    :mod:`gas_lab.rules.refusals`, checked before anything is built.
    """
    model, accumulate = model_dtype(cfg), grad_accum_dtype(cfg)
    if cfg.zero_optimization.stage == 0:
        # DeepSpeed's DDP_BFLOAT16 path; fp32 has no overflow check at all at stage 0.
        wrapper = None if model == torch.float32 else "FP16_UnfusedOptimizer"
        skip = model != torch.float32
    elif model == torch.bfloat16 and accumulate == torch.float32:
        wrapper, skip = "BF16_Optimizer", True
    else:
        # ZeRO skips on an invalid norm, except bf16 with check_grad_overflow false.
        wrapper = "DeepSpeedZeroOptimizer"
        skip = model != torch.bfloat16 or cfg.bf16.check_grad_overflow
    return Precision(
        model, accumulate, communication_dtype(cfg), wrapper, skip, cfg.bf16.immediate_grad_update
    )


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters in place (same Parameter objects, so an optimizer
    built on them stays valid); buffers keep their dtype, as DeepSpeed does."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def fp32_masters(params: list[torch.nn.Parameter], optimizer) -> list[torch.Tensor]:
    """fp32 copies of ``params`` that ``optimizer`` steps on instead of them (the model keeps
    the low-precision weights and gets the new values copied back after every update)."""
    index = {id(p): i for i, p in enumerate(params)}
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    for group in optimizer.param_groups:
        group["params"] = [masters[index[id(p)]] for p in group["params"] if id(p) in index]
    return masters


class GradBuffers:
    """Gradients added up in ``dtype`` outside ``.grad`` (DeepSpeed's ``BF16_Optimizer``).

    Before each backward ``.grad`` is cleared; after it, the micro-batch's gradient is added
    into the buffer in ``dtype`` (fp32: one rounding per micro-batch fewer than in bf16).
    With ``immediate`` (``bf16.immediate_grad_update``) ``.grad`` is freed right away.
    """

    def __init__(self, params, dtype: torch.dtype, immediate: bool = False):
        self.params, self.immediate = list(params), immediate
        self.buffers = [torch.zeros_like(p, dtype=dtype) for p in self.params]

    def before_backward(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def after_backward(self) -> None:
        for p, buf in zip(self.params, self.buffers, strict=True):
            if p.grad is not None:
                buf.add_(p.grad.to(buf.dtype))
                if self.immediate:
                    p.grad = None

    def clear(self) -> None:
        for buf in self.buffers:
            buf.zero_()
