"""A DeepSpeed-style config dict, checked and completed.

gas_lab reads the same JSON-like dict as ``deepspeed.initialize(config=...)``, with the same
defaults as DeepSpeed 0.19.8 (the optimizer's differ per path: :mod:`gas_lab.deepspeed_compat.optimizers`), and
is stricter on purpose: an unknown key or a value of the wrong type is an error naming the key
(DeepSpeed silently ignores unknown top-level keys, and ``"managed_gradient_accumulation":
"no"`` is truthy, i.e. *managed*); a DeepSpeed key the course does not implement is refused as
not supported (:mod:`gas_lab.deepspeed_compat.keys`); a key gas_lab accepts is read, or says at its
field that DeepSpeed ignores it too. So a config gas_lab accepts trains to DeepSpeed's numbers.

The batch invariant, as DeepSpeed states it::

    train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size

Give any two of the three and the third is derived (integer division, as DeepSpeed does, then
the invariant is checked, so 10 = 3 x ? x 1 is an error rather than a silent 9).

The config arrives as ``deepspeed.initialize`` takes it (:func:`choose_config`: ``config=``,
``config_params=`` or ``args.deepspeed_config``; :func:`read_config`: a dict, a JSON file or
base64-encoded JSON). Taught alongside the engine in lesson 03; lesson 06 explains the refusals
it applies.
"""

from __future__ import annotations

import base64
import json
import math
import os
from typing import Annotated, Any

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from gas_lab.deepspeed_compat import keys, optimizers, precision, schedules
from gas_lab.errors import ConfigError, NotImplementedInGasLab
from gas_lab.rules import refusals


class _Section(BaseModel):
    # strict: "2" is not 2 and "no" is not a bool; forbid: a typo is an error, not a default.
    model_config = ConfigDict(extra="forbid", strict=True)


def _whole_number(value: Any) -> Any:
    # DeepSpeed configs often write 5e8; a bool, a string or 2.5 is a mistake here.
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


Elements = Annotated[int, BeforeValidator(_whole_number), Field(lt=2**63)]


class OptimizerConfig(_Section):
    """``{"type": ..., "params": {...}}``, checked per DeepSpeed path (:mod:`gas_lab.deepspeed_compat.optimizers`)."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    def plan(self) -> optimizers.Plan:
        """What DeepSpeed builds for this block, and the torch optimizer gas_lab builds."""
        return optimizers.plan(self.type, self.params)

    def torch_optimizer(self, parameters) -> torch.optim.Optimizer:
        """The optimizer DeepSpeed 0.19.8 would build, as torch (its defaults per path)."""
        return self.plan().build(parameters)


class ZeroConfig(_Section):
    """``zero_optimization``. Every key is read, or accepted and ignored where DeepSpeed ignores
    it (said at the field). Stages 0, 1 and 2 are built (:func:`.strategies.strategy_for`);
    stage 3, and stage 2 below fp32, are refused as out of scope (:mod:`gas_lab.rules.out_of_scope`)."""

    stage: int = Field(0, ge=0, le=3)
    # Stage 1's gradient reduction follows the next five exactly as DeepSpeed's does
    # (gas_lab/deepspeed_compat/buckets.py). Stage 0 ignores them, as DeepSpeed does (fixed 5e8 buckets).
    reduce_bucket_size: Elements = Field(500_000_000, gt=0)  # elements per collective
    reduce_scatter: bool = True  # false: one all_reduce per bucket, predivide/prescale apply
    use_multi_rank_bucket_allreduce: bool = True  # false: a reduce to each owning rank
    contiguous_gradients: bool = True  # false: one all_reduce per bucket, divided first
    compute_grad_norm: bool = True  # false (stage 1, gradient_clipping 0): no norm all_reduce
    # None: DeepSpeed's default, true only at stage 3. Refused unmanaged (rules). Managed,
    # accepted and ignored: DeepSpeed's hooks reduce at the boundary backward, as gas_lab does.
    overlap_comm: bool | None = None
    # Accepted and ignored, as in DeepSpeed 0.19.8 at stage 1 with torch's all_gather_into_tensor
    # (one all-gather per param group); still checked as DeepSpeed does (even at stage 1).
    allgather_bucket_size: Elements = Field(500_000_000, ge=0)
    allgather_partitions: bool = True  # accepted and ignored: DeepSpeed reads it nowhere
    # Stage 1: the order of each group's parameters in the flat vector (which rank owns what),
    # as DeepSpeed lays them out; the numbers are the same either way.
    round_robin_gradients: bool = False
    offload_optimizer: keys.OffloadOptimizerSection | None = None  # device: refused
    offload_param: keys.OffloadParamSection | None = None  # device: refused

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def offloads(self) -> bool:
        blocks = (self.offload_optimizer, self.offload_param)
        return any(b is not None and b.device != "none" for b in blocks)


class GasConfig(keys.SwitchedOffKeys, _Section):
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    managed_gradient_accumulation: bool = True
    optimizer: OptimizerConfig | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    zero_allow_untested_optimizer: bool = False
    # DeepSpeed 0.19.8 clips at 1.0 by default; 0 or less: no clipping (DeepSpeed's test is > 0).
    gradient_clipping: float = 1.0
    # Where the division by the world size happens (stage 0, and stage 1 with reduce_scatter
    # false), as in DeepSpeed: the mean is the same, the rounding may differ for W not 2^k.
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    fp16: keys.Fp16Section = Field(default_factory=keys.Fp16Section)
    compile: keys.CompileSection = Field(default_factory=keys.CompileSection)
    amp: dict | None = None  # only so gas_lab/rules/config_refusals.py can say why it is refused
    # Accepted and ignored, as DeepSpeed ignores it without a PipelineModule (refused: rules).
    pipeline: dict | None = None
    steps_per_print: int | None = None  # accepted and ignored (DeepSpeed's logging); 0 refused
    wall_clock_breakdown: bool = False  # accepted and ignored: DeepSpeed's timers
    log_level: str | None = None  # accepted and ignored: DeepSpeed's logging
    world_size: int = Field(1, exclude=True)  # not a DeepSpeed key: filled in by load_config
    # Lesson 08: schedules (gas_lab/deepspeed_compat/schedules.py), sum or mean, precision (gas_lab/deepspeed_compat/precision.py).
    scheduler: schedules.SchedulerConfig | None = None
    gradient_allreduce_op: str = "mean"  # "sum": no division by the world size
    bf16: precision.Bf16Config = Field(default_factory=precision.Bf16Config)
    data_types: precision.DataTypesConfig = Field(default_factory=precision.DataTypesConfig)
    communication_data_type: str | None = None  # None: bf16 when bf16 is on, else fp32
    dataloader_drop_last: bool = False  # for initialize(training_data=...)

    @field_validator("gradient_clipping", "gradient_predivide_factor")
    @classmethod
    def _a_number(cls, value: float, info) -> float:
        if math.isnan(value) or (info.field_name == "gradient_predivide_factor" and value <= 0):
            raise ValueError(f"must be a number{' > 0' if value == value else ''}, got {value}")
        return value

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
    cfg = with_batch(parse(config), world_size)
    # Model-independent rules; engine.initialize checks again once it knows the model.
    refusals.enforce(refusals.Situation(config=cfg))
    return cfg


def with_batch(cfg: GasConfig, world_size: int) -> GasConfig:
    """``cfg`` with its three batch numbers derived and checked for ``world_size`` (in place)."""
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = (
        resolve_batch(
            cfg.train_batch_size,
            cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps,
            world_size,
        )
    )
    cfg.world_size = world_size
    return cfg


def parse(config: dict | GasConfig) -> GasConfig:
    """Check keys and types only: no batch arithmetic, no rules (``prediction.predict`` uses it)."""
    if isinstance(config, GasConfig):
        config = config.model_dump(exclude_unset=True)
    if not isinstance(config, dict):
        raise ConfigError("<config>", f"expected a dict, got {type(config).__name__}")
    if "world_size" in config:
        raise ConfigError(
            "world_size",
            "not a DeepSpeed key: the world size is the process "
            "group's (give train_batch_size and the micro-batch size instead)",
        )
    config = keys.check_known(config)  # what does nothing is accepted, and left out
    if "amp" in config and config["amp"] is None:
        config = {**config, "amp": {}}  # DeepSpeed refuses the key itself, even null (rules)
    try:
        cfg = GasConfig.model_validate(config)
    except ValidationError as err:
        raise _pydantic_to_config_error(err) from None
    if cfg.optimizer is not None:
        cfg.optimizer.type = optimizers.normalize_type(cfg.optimizer.type)
        optimizers.check(cfg.optimizer.type, cfg.optimizer.params)
    _check_zero(cfg)
    schedules.check(cfg.scheduler)
    return cfg


def _check_zero(cfg: GasConfig) -> None:
    """What DeepSpeed checks across keys when it builds its engine and ZeRO optimizer."""
    if cfg.steps_per_print == 0:
        raise ConfigError(
            "steps_per_print",
            "0: DeepSpeed divides the step count by it at the "
            "first update (ZeroDivisionError); null never prints",
            deepspeed_raises=ZeroDivisionError,
        )
    zero = cfg.zero_optimization
    if zero.stage in (1, 2) and zero.allgather_bucket_size % 2:
        raise ConfigError(
            "zero_optimization.allgather_bucket_size",
            f"{zero.allgather_bucket_size} at stage {zero.stage}: must be even (DeepSpeed "
            "asserts it is a multiple of its alignment, 2)",
            deepspeed_raises=AssertionError,
        )
    if not zero.compute_grad_norm:
        if zero.stage not in (1, 2):
            raise ConfigError(
                "zero_optimization.compute_grad_norm",
                "false is supported only with ZeRO stage 1 or 2 (as in DeepSpeed)",
            )
        if cfg.gradient_clipping > 0:
            raise ConfigError(
                "zero_optimization.compute_grad_norm",
                f"false needs gradient_clipping 0 (it is {cfg.gradient_clipping}): clipping "
                "needs the norm (DeepSpeed raises ValueError at initialize)",
            )
        if cfg.bf16.enabled:
            raise NotImplementedInGasLab(
                "config key 'zero_optimization.compute_grad_norm': false with bf16 is not "
                "supported by gas_lab; use deepspeed.initialize"
            )


# -- reading the config as deepspeed.initialize does --------------------------------------------
def choose_config(args, config, config_params):
    """The one config among ``config``, ``config_params`` and ``args.deepspeed_config``, as
    ``deepspeed.initialize`` picks it (``args.deepscale_config``: its deprecated name)."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ConfigError(
                "<config>",
                "given twice, in args.deepspeed_config and in "
                "initialize(config=...): keep one (DeepSpeed asserts the same)",
                deepspeed_raises=AssertionError,
            )
        config = from_args
    if config is None:
        raise ConfigError(
            "<config>",
            "none given: pass initialize(config=...) or args.deepspeed_config (--deepspeed_config)",
            deepspeed_raises=AssertionError,
        )
    return config


def read_config(config) -> dict:
    """A config dict, or what a path names (a JSON file, read as DeepSpeed reads it: hjson
    where installed, duplicate keys refused), or a base64-encoded JSON string."""
    if isinstance(config, (dict, GasConfig)):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError("<config>", f"expected a dict or a path, got {type(config).__name__}")
    if os.path.isfile(config):
        with open(config) as f:
            return _parse_json(f.read(), f"file {os.fspath(config)}")
    try:
        text = base64.urlsafe_b64decode(str(config)).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(
            "<config>",
            f"{config!r} is neither a JSON file nor base64-encoded "
            "JSON (DeepSpeed raises ValueError too)",
        ) from None
    return _parse_json(text, "base64 string")


def _parse_json(text: str, where: str) -> dict:
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        duplicate = next((k for k in keys if keys.count(k) > 1), None)
        if duplicate is not None:
            raise ConfigError(duplicate, f"appears twice in the config {where}")
        return dict(pairs)

    try:
        import hjson  # DeepSpeed's reader: JSON plus comments and trailing commas

        loads = hjson.loads
    except ImportError:
        loads = json.loads
    # One try for either reader: a syntax error is a ConfigError whichever one read it.
    try:
        parsed = loads(text, object_pairs_hook=no_duplicates)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError("<config>", f"the config {where} is not JSON: {err}") from None
    if not isinstance(parsed, dict):
        raise ConfigError("<config>", f"the config {where} holds a {type(parsed).__name__}")
    return parsed
