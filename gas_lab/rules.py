"""The combinations gas_lab refuses, written down as data.

DeepSpeed refuses some settings outright: most of them because, with
``managed_gradient_accumulation=false``, the *caller* decides where the accumulation boundary
is (every ``step()`` is one), and a feature that needs to know the boundary in advance can no
longer know it. This module lists each refusal once: the condition, a reason a learner can
follow, the moment it fires and what DeepSpeed 0.19.8 raises (measured, not copied from
documentation). ``config.py`` and ``engine.py`` call :func:`enforce`; notebooks print
:data:`RULES` as a table; tests run every :class:`Rule`'s example on gas_lab *and* on DeepSpeed.

A second list, :data:`OUT_OF_SCOPE`, names what DeepSpeed accepts but gas_lab does not teach
(ZeRO-2/3, offload, pipelines, compilation, mixed precision): those raise
:class:`NotImplementedInGasLab`, which points you back to DeepSpeed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class GasLabError(Exception):
    """Base class of every error gas_lab raises on purpose."""


class RejectedCombination(GasLabError):
    """A combination DeepSpeed rejects too; the message says why and what DeepSpeed raises."""

    def __init__(self, rule: Rule):
        self.rule = rule
        super().__init__(
            f"{' + '.join(rule.keys)}: {rule.reason}\n"
            f"  (DeepSpeed 0.19.8 raises {rule.deepspeed_raises} at {rule.moment}: "
            f"{rule.deepspeed_message!r})"
        )


class NotImplementedInGasLab(GasLabError, NotImplementedError):
    """Something DeepSpeed supports that this course deliberately leaves out."""


@dataclass(frozen=True)
class Situation:
    """What a rule looks at: the validated config and what the caller is doing right now."""

    config: Any  # a gas_lab.config.GasConfig (duck-typed so this module imports nothing)
    action: str = "initialize"  # or an engine method: "step", "no_sync", ...
    inside_no_sync: bool = False
    pipeline: bool = False  # the model is a DeepSpeed PipelineModule


@dataclass(frozen=True)
class Example:
    """How to trigger a rule: config overrides (merged into a working config) and an action."""

    config: dict = field(default_factory=dict)
    action: str = "initialize"  # or: set_boundary, coalesce, step_in_no_sync, no_sync_twice
    pipeline: bool = False


@dataclass(frozen=True)
class Rule:
    name: str
    moment: str  # "initialize", "call" (an engine method) or "context" (entering a with-block)
    keys: tuple[str, ...]  # the config keys or API calls involved, for the message
    condition: str  # one line, for tables
    reason: str  # why it is refused, for a learner
    deepspeed_raises: str  # the exception type DeepSpeed 0.19.8 raises (measured)
    deepspeed_message: str  # its message (measured; tests check it is still a substring)
    example: Example
    applies: Callable[[Situation], bool] = field(repr=False, compare=False, default=None)


def _unmanaged(s: Situation) -> bool:
    return not s.config.managed_gradient_accumulation


def _stage(s: Situation) -> int:
    return s.config.zero_optimization.stage


UNMANAGED = {"managed_gradient_accumulation": False}

RULES: list[Rule] = [
    Rule(
        name="apex_amp",
        moment="initialize",
        keys=("amp",),
        condition='an "amp" block is present (managed or not)',
        reason="NVIDIA Apex AMP was removed from DeepSpeed; older versions refused it only with "
        "unmanaged accumulation, because Apex scales the loss per optimizer step and needs "
        "the boundary in advance. Use bf16/fp16 or torch_autocast instead.",
        deepspeed_raises="DeepSpeedConfigError",
        deepspeed_message="NVIDIA Apex AMP integration has been removed.",
        example=Example(config={**UNMANAGED, "amp": {"enabled": True}}),
        applies=lambda s: s.config.amp is not None,
    ),
    Rule(
        name="unmanaged_overlap_comm",
        moment="initialize",
        keys=("managed_gradient_accumulation=false", "zero_optimization.overlap_comm"),
        condition="unmanaged, ZeRO stage 0/1, overlap_comm true",
        reason="overlap_comm starts reducing gradients during the last backward() of a step, so "
        "it must know which backward() is the last one. Unmanaged, only the later step() "
        "says so; at stage 0/1 the reduction waits for step() and there is nothing to overlap.",
        deepspeed_raises="AssertionError",
        deepspeed_message="managed_gradient_accumulation=False supports ZeRO overlap_comm only "
        "with ZeRO stage 2",
        example=Example(config={**UNMANAGED, "zero_optimization": {"overlap_comm": True}}),
        applies=lambda s: _unmanaged(s) and _stage(s) < 2 and s.config.zero_optimization.overlap,
    ),
    Rule(
        name="unmanaged_pipeline",
        moment="initialize",
        keys=("managed_gradient_accumulation=false", "PipelineModule"),
        condition="unmanaged with a pipeline-parallel model",
        reason="The pipeline engine runs its own schedule of gradient_accumulation_steps "
        "micro-batches inside train_batch(); the schedule owns the boundary, the caller cannot.",
        deepspeed_raises="AssertionError",
        deepspeed_message="managed_gradient_accumulation=False is not supported with pipeline "
        "parallelism",
        example=Example(config=UNMANAGED, pipeline=True),
        applies=lambda s: _unmanaged(s) and s.pipeline,
    ),
    Rule(
        name="unmanaged_deepcompile",
        moment="initialize",
        keys=("managed_gradient_accumulation=false", "compile.deepcompile"),
        condition="unmanaged with DeepCompile",
        reason="DeepCompile compiles the gradient reduction into the backward graph, deciding "
        "per backward() from the managed micro-step counter; it cannot wait for a step().",
        deepspeed_raises="AssertionError",
        deepspeed_message="managed_gradient_accumulation=False is not supported with DeepCompile",
        example=Example(config={**UNMANAGED, "compile": {"deepcompile": True}}),
        applies=lambda s: _unmanaged(s) and s.config.compile.deepcompile,
    ),
    Rule(
        name="max_grad_norm_param",
        moment="initialize",
        keys=("optimizer.params.max_grad_norm",),
        condition="max_grad_norm inside the optimizer params",
        reason="DeepSpeed clips gradients itself, once per optimizer step, from the top-level "
        "gradient_clipping key (default 1.0); an optimizer-level max_grad_norm would be ignored.",
        deepspeed_raises="ValueError",
        deepspeed_message="'max_grad_norm' is not supported as an optimizer parameter",
        example=Example(
            config={"optimizer": {"type": "SGD", "params": {"lr": 0.1, "max_grad_norm": 1.0}}}
        ),
        applies=lambda s: (
            s.config.optimizer is not None
            and s.config.optimizer.params.get("max_grad_norm") is not None
        ),
    ),
    Rule(
        name="untested_zero_optimizer",
        moment="initialize",
        keys=("zero_optimization.stage>=1", "optimizer.type", "zero_allow_untested_optimizer"),
        condition="ZeRO stage >= 1 with SGD and zero_allow_untested_optimizer false",
        reason="ZeRO re-points the optimizer at flat shards of the parameters; DeepSpeed only "
        "vouches for the Adam family there, so anything else needs an explicit opt-in.",
        deepspeed_raises="AssertionError",
        deepspeed_message="You are using an untested ZeRO Optimizer.",
        example=Example(
            config={"zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {}}},
        ),
        applies=lambda s: (
            _stage(s) >= 1
            and s.config.optimizer is not None
            and s.config.optimizer.type == "SGD"
            and not s.config.zero_allow_untested_optimizer
        ),
    ),
    Rule(
        name="unmanaged_set_boundary",
        moment="call",
        keys=("managed_gradient_accumulation=false", "set_gradient_accumulation_boundary()"),
        condition="unmanaged, set_gradient_accumulation_boundary() called",
        reason="Unmanaged, every step() is the boundary; a second way to set it would contradict "
        "the first. Call step() when you want the reduction and the update.",
        deepspeed_raises="AssertionError",
        deepspeed_message="set_gradient_accumulation_boundary() is not supported with "
        "managed_gradient_accumulation=False",
        example=Example(config=UNMANAGED, action="set_boundary"),
        applies=lambda s: _unmanaged(s) and s.action == "set_gradient_accumulation_boundary",
    ),
    Rule(
        name="unmanaged_coalesce",
        moment="call",
        keys=("managed_gradient_accumulation=false", "coalesce_grad_reduction()"),
        condition="unmanaged, coalesce_grad_reduction() entered",
        reason="coalesce_grad_reduction() defers the reduction to the end of a block of "
        "backward() calls; unmanaged, step() already does exactly that.",
        deepspeed_raises="AssertionError",
        deepspeed_message="coalesce_grad_reduction is not supported with "
        "managed_gradient_accumulation=False",
        example=Example(config=UNMANAGED, action="coalesce"),
        applies=lambda s: _unmanaged(s) and s.action == "coalesce_grad_reduction",
    ),
    Rule(
        name="coalesce_stage0",
        moment="call",
        keys=("zero_optimization.stage=0", "coalesce_grad_reduction()"),
        condition="managed, ZeRO stage 0, coalesce_grad_reduction() entered",
        reason="Coalescing is implemented by the ZeRO optimizers; at stage 0 use no_sync() "
        "around all but the last backward() instead.",
        deepspeed_raises="NotImplementedError",
        deepspeed_message="coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage 0",
        example=Example(action="coalesce"),
        applies=lambda s: (
            not _unmanaged(s) and _stage(s) == 0 and s.action == "coalesce_grad_reduction"
        ),
    ),
    Rule(
        name="step_in_no_sync",
        moment="call",
        keys=("no_sync()", "step()"),
        condition="step() called inside no_sync()",
        reason="no_sync() means 'do not reduce yet', but step() updates the weights from the "
        "reduced gradients: each rank would apply its own, different update.",
        deepspeed_raises="AssertionError",
        deepspeed_message="It is illegal to call Engine.step() inside no_sync context manager",
        example=Example(action="step_in_no_sync"),
        applies=lambda s: s.action == "step" and s.inside_no_sync,
    ),
    Rule(
        name="no_sync_twice",
        moment="context",
        keys=("no_sync()", "no_sync()"),
        condition="no_sync() entered while already inside no_sync()",
        reason="Leaving the inner block would switch reduction back on while the outer block "
        "still expects it off.",
        deepspeed_raises="AssertionError",
        deepspeed_message="no_sync context manager reentry is unsupported",
        example=Example(action="no_sync_twice"),
        applies=lambda s: s.action == "no_sync" and s.inside_no_sync,
    ),
]


@dataclass(frozen=True)
class OutOfScope:
    name: str
    moment: str
    condition: str
    pointer: str  # where to go instead
    applies: Callable[[Situation], bool] = field(repr=False, compare=False, default=None)


OUT_OF_SCOPE: list[OutOfScope] = [
    OutOfScope(
        "zero_stage_2_3",
        "initialize",
        "zero_optimization.stage 2 or 3",
        "ZeRO-2/3 partition gradients/parameters; use deepspeed.initialize for them.",
        lambda s: _stage(s) >= 2,
    ),
    OutOfScope(
        "offload",
        "initialize",
        "zero_optimization.offload_optimizer / offload_param with a device",
        "CPU/NVMe offload is DeepSpeed-only; use deepspeed.initialize.",
        lambda s: s.config.zero_optimization.offloads(),
    ),
    OutOfScope(
        "pipeline",
        "initialize",
        "a PipelineModule model",
        "Pipeline parallelism is DeepSpeed-only (deepspeed.pipe); use deepspeed.initialize.",
        lambda s: s.pipeline,
    ),
    OutOfScope(
        "deepcompile",
        "initialize",
        "compile.deepcompile true",
        "DeepCompile is DeepSpeed-only; use deepspeed.initialize.",
        lambda s: s.config.compile.deepcompile,
    ),
    OutOfScope(
        "mixed_precision",
        "initialize",
        "bf16.enabled or fp16.enabled",
        "gas_lab trains in fp32 so results compare exactly; use deepspeed.initialize for bf16/fp16.",
        lambda s: s.config.bf16.enabled or s.config.fp16.enabled,
    ),
    OutOfScope(
        "coalesce_zero",
        "call",
        "coalesce_grad_reduction() at ZeRO stage >= 1",
        "Coalesced ZeRO reduction is DeepSpeed-only; use deepspeed.initialize.",
        lambda s: s.action == "coalesce_grad_reduction" and _stage(s) >= 1,
    ),
]


def enforce(situation: Situation, moment: str) -> None:
    """Raise for the first rule, then the first out-of-scope entry, that applies now."""
    for rule in RULES:
        if rule.moment == moment and rule.applies(situation):
            raise RejectedCombination(rule)
    for item in OUT_OF_SCOPE:
        if item.moment == moment and item.applies(situation):
            raise NotImplementedInGasLab(
                f"{item.condition} is out of gas_lab's scope. {item.pointer}"
            )


def example_config(rule: Rule, base: dict) -> dict:
    """The full config of a rule's example: ``base`` with the example's keys merged in.

    Sections merge key by key, except "optimizer", which is replaced whole (its params belong
    to its type: Adam's betas mean nothing to SGD).
    """
    config = merge(base, {k: v for k, v in rule.example.config.items() if k != "optimizer"})
    if "optimizer" in rule.example.config:
        config["optimizer"] = copy.deepcopy(rule.example.config["optimizer"])
    return config


def merge(base: dict, overrides: dict) -> dict:
    """Deep-merge ``overrides`` into a copy of ``base``."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def table() -> list[dict]:
    """The rules as rows (for a notebook table or the docs)."""
    return [
        {
            "rule": r.name,
            "when": r.moment,
            "condition": r.condition,
            "why": r.reason,
            "DeepSpeed raises": f"{r.deepspeed_raises}: {r.deepspeed_message}",
        }
        for r in RULES
    ]
