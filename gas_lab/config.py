"""A DeepSpeed-style config dict, checked and completed.

gas_lab reads the same JSON-like dict as ``deepspeed.initialize(config=...)``, with the same
defaults as DeepSpeed 0.19.8, and is stricter in two ways on purpose: an unknown key or a value
of the wrong type is an error naming the key (DeepSpeed silently ignores unknown top-level keys,
and ``"managed_gradient_accumulation": "no"`` is truthy, i.e. *managed*).

The batch invariant, as DeepSpeed states it::

    train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size

Give any two of the three and the third is derived (integer division, as DeepSpeed does, then
the invariant is checked, so 10 = 3 x ? x 1 is an error rather than a silent 9).

Taught alongside the engine in lesson 03; lesson 06 explains the refusals it applies.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gas_lab import precision, schedules
from gas_lab.errors import ConfigError, NotImplementedInGasLab
from gas_lab.rules import refusals


class _Section(BaseModel):
    # strict: "2" is not 2 and "no" is not a bool; forbid: a typo is an error, not a default.
    model_config = ConfigDict(extra="forbid", strict=True)


LaxInt = Annotated[int, Field(strict=False, gt=0)]  # DeepSpeed configs often write 5e8


# Optimizer params: None means "not given", and then torch's own default applies, exactly as
# in DeepSpeed (which passes the dict through): e.g. AdamW's weight_decay default is 0.01.
class SGDParams(_Section):
    lr: float | None = None
    momentum: float | None = None
    dampening: float | None = None
    weight_decay: float | None = None
    nesterov: bool | None = None
    max_grad_norm: float | None = None  # accepted only so the rule can explain the refusal


class AdamParams(_Section):
    lr: float | None = None
    betas: Annotated[tuple[float, float], Field(strict=False)] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    amsgrad: bool | None = None
    torch_adam: bool | None = None  # DeepSpeed: torch's Adam instead of a JIT-built FusedAdam
    adam_w_mode: bool | None = None  # DeepSpeed: type "Adam" means AdamW unless this is false
    max_grad_norm: float | None = None


_TAUGHT = {"sgd": ("SGD", SGDParams), "adam": ("Adam", AdamParams), "adamw": ("AdamW", AdamParams)}
_DEEPSPEED_ONLY = {"adagrad", "lamb", "lion", "muadam", "muadamw", "musgd", "muon", "onebitadam"}


class OptimizerConfig(_Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)  # checked by load_config per type

    def torch_optimizer(self, parameters) -> torch.optim.Optimizer:
        """Build the torch optimizer DeepSpeed 0.19.8 would build for this block."""
        params = dict(self.params)
        params.pop("max_grad_norm", None)
        params.pop("torch_adam", None)  # gas_lab always uses torch's implementation
        if self.type == "SGD":
            return torch.optim.SGD(parameters, **params)
        # DeepSpeed's surprise: type "Adam" runs AdamW (decoupled weight decay) unless
        # adam_w_mode is false; type "AdamW" is AdamW whatever adam_w_mode says.
        adam_w = params.pop("adam_w_mode", True) is not False or self.type == "AdamW"
        return (torch.optim.AdamW if adam_w else torch.optim.Adam)(parameters, **params)


class ZeroConfig(_Section):
    stage: int = Field(0, ge=0, le=3)
    overlap_comm: bool | None = None  # None: DeepSpeed's default, true only at stage 3
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: LaxInt = 500_000_000
    allgather_bucket_size: LaxInt = 500_000_000
    allgather_partitions: bool = True
    round_robin_gradients: bool = False
    offload_optimizer: dict | None = None
    offload_param: dict | None = None

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def offloads(self) -> bool:
        blocks = (self.offload_optimizer, self.offload_param)
        return any(b and b.get("device", "none") not in (None, "none") for b in blocks)


class _Switch(BaseModel):
    # Sections gas_lab does not implement: only "enabled" matters (out of scope when true).
    model_config = ConfigDict(extra="allow", strict=True)
    enabled: bool = False


class CompileConfig(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    deepcompile: bool = False


class GasConfig(_Section):
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    managed_gradient_accumulation: bool = True
    optimizer: OptimizerConfig | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    zero_allow_untested_optimizer: bool = False
    gradient_clipping: float = Field(1.0, ge=0.0)  # DeepSpeed 0.19.8 clips at 1.0 by default
    fp16: _Switch = Field(default_factory=_Switch)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    amp: dict | None = None  # present only so gas_lab/rules/refusals.py can say why it is refused
    pipeline: dict | None = None  # DeepSpeed's pipeline section; used only with PipelineModule
    steps_per_print: int | None = None  # logging only
    wall_clock_breakdown: bool = False  # logging only
    world_size: int = Field(1, exclude=True)  # not a DeepSpeed key: filled in by load_config
    # Lesson 08: schedules (gas_lab/schedules.py), sum or mean, precision (gas_lab/precision.py).
    scheduler: schedules.SchedulerConfig | None = None
    gradient_allreduce_op: str = "mean"  # "sum": no division by the world size
    bf16: precision.Bf16Config = Field(default_factory=precision.Bf16Config)
    data_types: precision.DataTypesConfig = Field(default_factory=precision.DataTypesConfig)
    communication_data_type: str | None = None  # None: bf16 when bf16 is on, else fp32
    dataloader_drop_last: bool = False  # for initialize(training_data=...)

    @field_validator("gradient_allreduce_op")
    @classmethod
    def _sum_or_mean(cls, value: str) -> str:
        if value.lower() not in ("mean", "sum"):  # DeepSpeed: any case, then these two
            raise ValueError(f"Supported operations: ['mean', 'sum']. Got: {value!r}")
        return value.lower()

    @field_validator("communication_data_type")
    @classmethod
    def _comm_dtype(cls, value: str | None) -> str | None:
        return precision.check_communication_data_type(value)

    @property
    def model_dtype(self) -> torch.dtype:
        return precision.model_dtype(self)

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        return precision.grad_accum_dtype(self)

    @property
    def samples_per_micro_batch(self) -> int:
        """Samples one micro-step consumes across all ranks (micro x world size)."""
        return self.train_batch_size // self.gradient_accumulation_steps


def resolve_batch(train: int | None, micro: int | None, gas: int | None, world_size: int):
    """Derive the missing batch numbers like DeepSpeed, then check the invariant."""
    if train is None and micro is None:
        raise ConfigError(
            "train_batch_size",
            "give train_batch_size or train_micro_batch_size_per_gpu (or both)",
        )
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for key, value in zip(names, (train, micro, gas), strict=True):
        if value is not None and value <= 0:
            raise ConfigError(key, f"is {value}; must be > 0")
    if gas is None:
        # train and micro known: GAS is what is left; only one known: no accumulation.
        gas = train // micro // world_size if train is not None and micro is not None else 1
    if micro is None:
        micro = train // world_size // gas
    if train is None:
        train = micro * gas * world_size
    for key, value in zip(names, (train, micro, gas), strict=True):
        if value <= 0:  # e.g. train_batch_size 2 on 4 ranks gives micro-batches of 0
            raise ConfigError(
                key, f"is {value} (derived with world size {world_size}); must be > 0"
            )
    if train != micro * gas * world_size:
        raise ConfigError(
            "train_batch_size",
            f"train_batch_size must equal micro x GAS x world size, "
            f"but {train} != {micro} x {gas} x {world_size}",
        )
    return train, micro, gas


def _pydantic_to_config_error(err: ValidationError, prefix: str = "") -> ConfigError:
    first = err.errors()[0]
    path = prefix + ".".join(str(part) for part in first["loc"])
    reason = first["msg"]
    if first["type"] == "extra_forbidden":
        reason = "unknown key (gas_lab accepts DeepSpeed's key names; check the spelling)"
    elif "input" in first and first["type"] != "missing":
        reason += f", got {first['input']!r}"
    more = len(err.errors()) - 1
    return ConfigError(
        path or "<config>", reason + (f" (and {more} more problems)" if more else "")
    )


def load_config(config: dict | GasConfig, world_size: int = 1) -> GasConfig:
    """Validate a DeepSpeed-style dict, fill in defaults and batch numbers, apply the rules.

    Raises ConfigError (a bad key or value), refusals.RejectedCombination (a combination DeepSpeed
    refuses at initialize) or refusals.NotImplementedInGasLab (fine in DeepSpeed, not taught here).
    """
    cfg = parse(config)
    batch = resolve_batch(
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
        world_size,
    )
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = (
        batch
    )
    cfg.world_size = world_size
    # Model-independent rules; engine.initialize checks again once it knows the model.
    refusals.enforce(refusals.Situation(config=cfg))
    return cfg


def parse(config: dict | GasConfig) -> GasConfig:
    """Check keys and types only: no batch arithmetic, no rules (``prediction.predict`` uses it)."""
    if isinstance(config, GasConfig):
        config = config.model_dump(exclude_unset=True)
    if not isinstance(config, dict):
        raise ConfigError("<config>", f"expected a dict, got {type(config).__name__}")
    try:
        cfg = GasConfig.model_validate(config)
    except ValidationError as err:
        raise _pydantic_to_config_error(err) from None
    if cfg.optimizer is not None:
        _check_optimizer(cfg.optimizer)
    schedules.check(cfg.scheduler)
    return cfg


def _check_optimizer(opt: OptimizerConfig) -> None:
    """Normalize the type name like DeepSpeed and validate the params for that type."""
    key = opt.type.lower()
    # DeepSpeed lower-cases its own optimizer names ("adam", "AdamW") but looks any other name
    # up in torch.optim as written, so "sgd" fails there and fails here.
    if key in ("adam", "adamw") or opt.type == "SGD":
        name, params_model = _TAUGHT[key]
    elif key in _DEEPSPEED_ONLY or hasattr(torch.optim, opt.type):
        raise NotImplementedInGasLab(
            f"optimizer.type {opt.type!r}: gas_lab teaches with SGD, Adam and AdamW; "
            "use deepspeed.initialize for other optimizers."
        )
    else:
        raise ConfigError(
            "optimizer.type", f"{opt.type!r} is neither a DeepSpeed nor a torch optimizer"
        )
    try:
        checked = params_model.model_validate(opt.params)
    except ValidationError as err:
        raise _pydantic_to_config_error(err, prefix="optimizer.params.") from None
    opt.type = name
    opt.params = checked.model_dump(exclude_none=True)  # only what the user wrote
