"""The combinations DeepSpeed refuses, written down once, as data.

With ``"managed_gradient_accumulation": false`` the *caller* owns the accumulation boundary:
every ``step()`` is one, and no ``backward()`` is. Any feature that does boundary-gated work
*during* ``backward()`` (reduce in a hook, unscale, compile the reduction into the graph) would
wait for a boundary that never comes there, so DeepSpeed refuses it. Each :class:`Rule` holds
the condition, why it is refused, what it prevents (wrong weights, extra communication or a
crash later in the loop: not always silent), the moment it fires
(``initialize``, ``call`` or ``context``: entering a with-block) and what DeepSpeed 0.19.8
raises, measured by ``python -m gas_lab.measure.matrix`` into ``data/deepspeed_0.19.8_matrix.json``.
A rule is checked at one engine call, its ``action`` (named in :mod:`gas_lab.rules.operations`).
Where two rules apply at the same call, the one DeepSpeed checks first fires: its ``order``,
by which :data:`ALL_RULES` is sorted. At ``initialize`` the hundreds say where DeepSpeed checks:
1xx while its config is parsed (``DeepSpeedConfig``), 2xx in its engine's sanity checks, 3xx
while it builds the optimizer and then checks it; in a method, its own checks in source order,
then what fails deeper inside it. The measured matrix holds every case where two apply.

* :data:`RULES`: the refusals gas_lab enforces itself, at the same moment as DeepSpeed
  (the config and the engine of :mod:`gas_lab.deepspeed_compat` call :func:`enforce`).
* :data:`DEEPSPEED_ONLY`: refusals DeepSpeed makes where gas_lab stops earlier (ZeRO-3, fp16
  are out of scope); kept for the table and for ``gas_lab.measure.prediction.predict``.
* :data:`OUT_OF_SCOPE`: what DeepSpeed accepts but gas_lab does not teach: those raise
  :class:`NotImplementedInGasLab`, which points you to ``deepspeed.initialize``.

Next door: ``gas_lab/measure/prediction.py`` evaluates these rules on a config and a script of engine
calls and holds the measured matrix they are checked against; ``gas_lab/rules/traps.py`` lists what
DeepSpeed *accepts* that still trains wrong.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gas_lab.errors import NotImplementedInGasLab, RejectedCombination
from gas_lab.rules.operations import ACTIONS


@dataclass(frozen=True)
class Situation:
    """What a rule looks at: the validated config and what the caller is doing right now."""

    config: Any  # a gas_lab.deepspeed_compat.config.GasConfig (duck-typed: rules sit below it)
    action: str | None = "initialize"  # the engine call (gas_lab.rules.operations); None: unchecked
    inside_no_sync: bool = False
    pipeline: bool = False  # the model is a DeepSpeed PipelineModule
    idle: bool = False  # a step() that would update, with no backward() since the last update
    # Managed: the boundary step() of a window whose boundary micro-step ran no backward()
    # that reduced (none, or one inside no_sync()), so the window's gradients were never averaged.
    no_boundary_backward: bool = False


@dataclass(frozen=True)
class Example:
    """How to trigger a rule: config overrides (merged into a working config) and the ops of
    :mod:`gas_lab.rules.operations` to run after ``initialize`` (none: initialize alone)."""

    config: dict = field(default_factory=dict)
    ops: tuple[str, ...] = ()
    pipeline: bool = False


SAME = "same rejection, same moment"


@dataclass(frozen=True)
class Rule:
    """One refusal: when it is checked, why, what it prevents, and what DeepSpeed raises."""

    name: str
    action: str  # the engine call it is checked at (gas_lab.rules.operations.ACTIONS)
    moment: str  # measured: "initialize", "call" (a method) or "context" (entering a with-block)
    keys: tuple[str, ...]  # the config keys or API calls involved, for the message
    condition: str  # one line, for tables
    reason: str  # why it is refused, for a learner
    prevents: str  # what goes wrong without it: silent, costly or a later crash
    deepspeed_raises: str  # the exception type DeepSpeed 0.19.8 raises (measured)
    deepspeed_message: str  # the start of its message (measured; tests check it still is)
    example: Example
    applies: Callable[[Situation], bool] = field(repr=False, compare=False, default=None)
    gas_lab: str = SAME  # what gas_lab does about it, when not the same rejection
    # Where two rules apply at the same call, the lower fires: DeepSpeed checks it first.
    order: int = 1000

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"Rule {self.name!r}: action {self.action!r} is none of {ACTIONS}")

    def __reduce__(self):
        # Ranks send refusals back pickled, and ``applies`` is often a lambda, which does not
        # pickle: a rule of ALL_RULES travels by name, any other without its condition.
        if next((r for r in ALL_RULES if r.name == self.name), None) == self:
            return rule_named, (self.name,)
        fields = {k: v for k, v in vars(self).items() if k != "applies"}
        return _rule_from_fields, (fields,)


def rule_named(name: str) -> Rule:
    """The rule of :data:`ALL_RULES` called ``name``."""
    return next(r for r in ALL_RULES if r.name == name)


def _rule_from_fields(fields: dict) -> Rule:
    return Rule(**fields)


def _unmanaged(s: Situation) -> bool:
    return not s.config.managed_gradient_accumulation


def _stage(s: Situation) -> int:
    return s.config.zero_optimization.stage


def _fp32_throughout(s: Situation) -> bool:
    """fp32 weights, fp32 accumulation, fp32 communication."""
    dtypes = (s.config.model_dtype, s.config.grad_accum_dtype)
    return all(str(d) == "torch.float32" for d in dtypes) and (
        s.config.communication_data_type in (None, "fp32")
    )


UNMANAGED = {"managed_gradient_accumulation": False}
_MGA = "managed_gradient_accumulation=false"

# Each rule's order: see the module docstring (ALL_RULES, below, is sorted by it).
_WRITTEN: list[Rule] = [
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
        lambda s: _stage(s) >= 1 and s.config.optimizer is not None
        and s.config.optimizer.type == "SGD" and not s.config.zero_allow_untested_optimizer,
        order=320,
    ),
    Rule(
        "unmanaged_overlap_comm", "initialize", "initialize",
        (_MGA, "zero_optimization.overlap_comm"),
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
        lambda s: _unmanaged(s) and _stage(s) < 2 and s.config.zero_optimization.overlap,
        order=220,
    ),
    Rule(
        "unmanaged_pipeline", "initialize", "initialize", (_MGA, "PipelineModule"),
        "unmanaged with a pipeline-parallel model",
        "The pipeline engine runs its own schedule of gradient_accumulation_steps micro-batches "
        "inside train_batch(); its backward() and step() cannot be called. The schedule owns "
        "the boundary, so the caller cannot.",
        "your loop's number of micro-batches would be ignored: every step would run exactly "
        "gradient_accumulation_steps of them.",
        "AssertionError", "managed_gradient_accumulation=False is not supported with pipeline "
        "parallelism",
        Example(config=UNMANAGED, pipeline=True),
        lambda s: _unmanaged(s) and s.pipeline,
        order=230,
    ),
    Rule(
        "unmanaged_deepcompile", "initialize", "initialize", (_MGA, "compile.deepcompile"),
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
        lambda s: _unmanaged(s) and s.config.compile.deepcompile,
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
        lambda s: s.config.gradient_allreduce_op == "sum" and _stage(s) == 3,
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
        lambda s: _stage(s) == 0 and not s.config.fp16.enabled
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
        lambda s: _stage(s) == 2 and s.config.zero_optimization.reduce_scatter
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
        lambda s: _stage(s) == 2 and s.config.zero_optimization.reduce_scatter
        and s.config.gradient_allreduce_op == "mean" and s.config.prescale_gradients,
        order=350,
    ),
    Rule(
        "unmanaged_set_boundary", "set_gradient_accumulation_boundary", "call",
        (_MGA, "set_gradient_accumulation_boundary()"),
        "unmanaged, set_gradient_accumulation_boundary(True or False)",
        "Unmanaged, every step() is the boundary; an override contradicts it both ways.",
        "False: step() neither reduces nor updates while micro_steps advances, so training "
        "silently stops. True: every backward() reduces and step() reduces again: N+1 "
        "reductions instead of 1 (at ZeRO-1 DeepSpeed's step() then fails: IndexError).",
        "AssertionError", "set_gradient_accumulation_boundary() is not supported with "
        "managed_gradient_accumulation=False",
        Example(config=UNMANAGED, ops=("set_boundary_true",)),
        _unmanaged,
        order=10,
    ),
    Rule(
        "unmanaged_coalesce", "coalesce_grad_reduction", "context",
        (_MGA, "coalesce_grad_reduction()"),
        "unmanaged, entering coalesce_grad_reduction() (any stage)",
        "coalesce_grad_reduction() is managed mode's way to defer the reduction to the end of a "
        "block of backward() calls; unmanaged, step() already defers it.",
        "the flush at the end of the block and step() would both reduce the same gradients.",
        "AssertionError", "coalesce_grad_reduction is not supported with "
        "managed_gradient_accumulation=False",
        Example(config=UNMANAGED, ops=("enter_coalesce", "exit_coalesce")),
        _unmanaged,
        order=10,
    ),
    Rule(
        "coalesce_stage0", "coalesce_grad_reduction", "context",
        ("zero_optimization.stage=0", "coalesce_grad_reduction()"),
        "managed, ZeRO stage 0, entering coalesce_grad_reduction()",
        "Coalescing is implemented inside the ZeRO optimizers; at stage 0 put no_sync() around "
        "all but the last backward() instead.",
        "nothing silent: the feature does not exist at stage 0.",
        "NotImplementedError", "coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage 0",
        Example(ops=("enter_coalesce", "exit_coalesce")),
        lambda s: _stage(s) == 0,
        order=20,
    ),
    Rule(
        "coalesce_nested", "coalesce_grad_reduction", "context",
        ("coalesce_grad_reduction()", "no_sync()"),
        "coalesce_grad_reduction() entered inside no_sync() or another coalesce block",
        "Both blocks switch the boundary reduction off; the inner block's exit would switch it "
        "back on and flush while the outer block still expects the gradients to stay local.",
        "the inner flush would reduce what the outer block keeps local, and its exit would "
        "reduce the same gradients again.",
        "AssertionError", "coalesce_grad_reduction cannot be nested inside another no_sync "
        "context",
        Example(config={"zero_optimization": {"stage": 1}}, ops=("enter_no_sync", "enter_coalesce")),
        lambda s: s.inside_no_sync,
        order=30,
    ),
    Rule(
        "no_sync_stage23", "no_sync", "context", ("zero_optimization.stage>=2", "no_sync()"),
        "entering no_sync() at ZeRO stage 2 or 3",
        "ZeRO-2/3 reduce every gradient inside backward() and keep only this rank's partition: "
        "stage 2 all-reduces each bucket (DeepSpeed's default, use_multi_rank_bucket_allreduce), "
        "stage 3 reduce-scatters it. There is no full local gradient to keep aside.",
        "nothing silent: no_sync() cannot be honoured.",
        "AssertionError", "no_sync context manager is incompatible with gradient partitioning",
        Example(config={"zero_optimization": {"stage": 2}}, ops=("enter_no_sync", "enter_no_sync")),
        lambda s: _stage(s) >= 2,
        order=10,
    ),
    Rule(
        "no_sync_twice", "no_sync", "context", ("no_sync()", "no_sync()"),
        "no_sync() entered while already inside no_sync()",
        "Leaving the inner block switches reduction back on while the outer block still "
        "expects it off.",
        "the next backward() inside the outer block would reduce (or the boundary would not).",
        "AssertionError", "no_sync context manager reentry is unsupported",
        Example(ops=("enter_no_sync", "enter_no_sync")),
        lambda s: s.inside_no_sync,
        order=20,
    ),
    Rule(
        "step_in_no_sync", "step", "call", ("no_sync()", "step()"),
        "step() called inside no_sync() (or inside coalesce_grad_reduction())",
        "no_sync() means 'do not reduce yet', but step() updates the weights from reduced "
        "gradients.",
        "each rank would apply its own, un-averaged update: the replicas drift apart.",
        "AssertionError", "It is illegal to call Engine.step() inside no_sync context manager",
        Example(ops=("enter_no_sync", "backward", "step")),
        lambda s: s.inside_no_sync,
        order=10,
    ),
    Rule(
        "tensor_backward_stage0", "loss.backward", "call",
        ("zero_optimization.stage=0", "loss.backward()"),
        "loss.backward() instead of engine.backward(loss) at ZeRO stage 0",
        "DeepSpeed's hook on the model's output sees every backward pass start. To accept "
        "loss.backward() it must also see the pass end, to run what engine.backward() runs "
        "after it, and only a ZeRO optimizer, which counts the gradients as autograd delivers "
        "them, can tell it that. Stage 0 has none, so the hook refuses the pass as it starts, "
        "managed or not. (At stages 1-3 that count signals the end, so a direct "
        "loss.backward() is accepted there, divided by GAS.)",
        "managed, the boundary all-reduce would never run: every rank would update from its "
        "own gradient and the replicas would drift apart.",
        "RuntimeError", "Direct calls to tensor.backward() are not supported",
        Example(ops=("tensor_backward",)),
        lambda s: _stage(s) == 0,
        order=10,
    ),
    # -- appendix A3: a rank with fewer micro-batches, none included (the one statement of the
    # rule: gas_lab.measure.idle_rank; measured in data/deepspeed_0.19.8_idle_rank.json) -------
    Rule(
        "idle_rank_stage1", "step", "call", (_MGA, "zero_optimization.stage=1", "step()"),
        "unmanaged, ZeRO stage 1, step() on a rank that ran no backward() since its last step()",
        "DeepSpeed's ZeRO-1 reduces, inside an unmanaged step(), the gradients this rank "
        "produced since the last one; with none it indexes an empty list and raises on this "
        "rank, while the other ranks wait in their gradient all-reduce and die when this one "
        "does. (Stage 0 reduces zeros for the missing gradients and trains right.) At stage 1 "
        "every rank calls backward() at least once: give an idle rank a dummy micro-batch "
        "whose loss is multiplied by 0 and counts no tokens (appendix A3 states the rule for "
        "every stage).",
        "a loop that trains here (zeros for the idle rank) and crashes on DeepSpeed the first "
        "time a rank gets no data.",
        "IndexError", "list index out of range",
        Example(config={**UNMANAGED, "zero_optimization": {"stage": 1}}, ops=("step",)),
        lambda s: _unmanaged(s) and _stage(s) == 1 and s.idle,
        order=20,
    ),
    Rule(
        "idle_window_stage1", "step", "call", ("zero_optimization.stage=1", "step()"),
        "managed, ZeRO stage 1, the boundary step() on a rank that ran no backward() in the "
        "boundary micro-step (none, or one inside no_sync())",
        "DeepSpeed's ZeRO-1 averages the window's gradients in the backward() of the boundary "
        "micro-step, and step() computes the gradient norm from that average. A rank that ran "
        "no backward() there has none, even with backward() calls earlier in the window, and "
        "raises in step() (KeyError instead, in the very first window). Managed, every rank "
        "calls backward() gradient_accumulation_steps times, once per micro-step: give a rank "
        "with fewer micro-batches zero-weight ones, whose loss is multiplied by 0 (appendix A3 "
        "states the rule).",
        "with every rank idle, an update from zero gradients (Adam's moments still move the "
        "weights); with one rank short, mismatched collectives.",
        "TypeError", "'NoneType' object is not iterable",
        # A full window, then one whose last micro-step runs no backward(): the refined case.
        Example(config={"zero_optimization": {"stage": 1}},
                ops=("backward", "step", "backward", "step", "backward", "step", "step")),
        lambda s: not _unmanaged(s) and _stage(s) == 1 and s.no_boundary_backward,
        order=20,
    ),
    Rule(
        "idle_rank_stage2", "step", "call", (_MGA, "zero_optimization.stage=2", "step()"),
        "unmanaged, ZeRO stage 2, step() on a rank that ran no backward() since its last step()",
        "DeepSpeed's ZeRO-2 finalizes, inside an unmanaged step(), the gradient partition this "
        "rank's backward() calls reduced into; with none the partition was never made and it "
        "raises on this rank, while the other ranks wait in a collective and die when this "
        "one does. At stage 2 every backward() reduces, so every rank calls it as often as "
        "the busiest rank: a rank with fewer micro-batches, none included, makes up the "
        "difference with zero-weight ones, whose loss is multiplied by 0 (appendix A3 states "
        "the rule).",
        "a loop that trains here and crashes on DeepSpeed the first time a rank gets no data.",
        "TypeError", "'NoneType' object is not subscriptable",
        # A step with data first: in the very first window DeepSpeed raises KeyError instead.
        Example(config={**UNMANAGED, "zero_optimization": {"stage": 2}}, ops=("backward", "step", "step")),
        lambda s: _unmanaged(s) and _stage(s) == 2 and s.idle,
        order=20,
    ),
    Rule(
        "idle_window_stage2", "step", "call", ("zero_optimization.stage=2", "step()"),
        "managed, ZeRO stage 2, the boundary step() on a rank that ran no backward() in the "
        "boundary micro-step",
        "As at stage 1 (the same DeepSpeed code): the backward() of the boundary micro-step "
        "finishes the gradient partition step() computes the norm from, and a rank that ran "
        "none there has none, even with backward() calls earlier in the window. Managed, "
        "every rank calls backward() gradient_accumulation_steps times, once per micro-step: "
        "give a rank with fewer micro-batches zero-weight ones, whose loss is multiplied by 0 "
        "(appendix A3 states the rule).",
        "with every rank idle, an update from zero gradients; with one rank short, mismatched "
        "collectives.",
        "TypeError", "'NoneType' object is not iterable",
        Example(config={"zero_optimization": {"stage": 2}},
                ops=("backward", "step", "backward", "step", "backward", "step", "step")),
        lambda s: not _unmanaged(s) and _stage(s) == 2 and s.no_boundary_backward,
        order=20,
    ),
    Rule(
        "idle_window_stage0_clipping", "step", "call",
        ("zero_optimization.stage=0", "gradient_clipping>0", "step()"),
        "managed, ZeRO stage 0, clipping on, the boundary step() on a rank that ran no "
        "backward() since the last update",
        "DeepSpeed clips the gradients that exist; with none it indexes an empty list. "
        "(Without clipping the optimizer skips parameters without a gradient: no update.) "
        "Managed, every rank calls backward() gradient_accumulation_steps times: give an idle "
        "rank zero-weight micro-batches, whose loss is multiplied by 0 (appendix A3 states the "
        "rule).",
        "nothing silent: refused because DeepSpeed fails here (with one rank idle, the ranks' "
        "collectives would not match anyway).",
        "IndexError", "list index out of range",
        Example(config={"gradient_accumulation_steps": 1, "gradient_clipping": 1.0},
                ops=("step",)),
        lambda s: not _unmanaged(s) and _stage(s) == 0 and s.config.gradient_clipping > 0
        and s.idle,
        order=20,
    ),
]  # fmt: skip

# Grouped by the call they are checked at, then in the order DeepSpeed checks them.
ALL_RULES: list[Rule] = sorted(_WRITTEN, key=lambda r: (ACTIONS.index(r.action), r.order))
RULES: list[Rule] = [r for r in ALL_RULES if r.gas_lab == SAME]
DEEPSPEED_ONLY: list[Rule] = [r for r in ALL_RULES if r.gas_lab != SAME]


@dataclass(frozen=True)
class OutOfScope:
    """Something DeepSpeed accepts that gas_lab leaves out; ``pointer`` says where to go."""

    name: str
    action: str
    condition: str
    pointer: str  # where to go instead
    applies: Callable[[Situation], bool] = field(repr=False, compare=False, default=None)


OUT_OF_SCOPE: list[OutOfScope] = [
    OutOfScope(
        "zero_stage_3", "initialize", "zero_optimization.stage 3",
        "ZeRO-3 partitions the parameters too (lesson 09 observes it on DeepSpeed); use "
        "deepspeed.initialize for it.",
        lambda s: _stage(s) >= 3,
    ),
    OutOfScope(
        "zero_stage_2_precision", "initialize",
        "ZeRO stage 2 with bf16 weights, or gradients accumulated or communicated below fp32",
        "gas_lab's ZeRO-2 (lesson 09) is fp32 from end to end; use deepspeed.initialize for "
        "mixed precision at stage 2.",
        lambda s: _stage(s) == 2 and not _fp32_throughout(s),
    ),
    OutOfScope(
        "zero_stage_2_variants", "initialize",
        "ZeRO stage 2 with contiguous_gradients or reduce_scatter or allgather_partitions false, "
        "or round_robin_gradients true",
        "gas_lab's ZeRO-2 (lesson 09) is DeepSpeed's default reduction (one bucket, all-reduce "
        "of packed slices, one all-gather); use deepspeed.initialize for its variants.",
        lambda s: _stage(s) == 2 and (
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
        lambda s: _stage(s) == 1 and not s.config.fp16.enabled
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

# Names of rules switched off for the current context: only gas_lab.measure.unsafe sets it.
_SKIPPED: contextvars.ContextVar[frozenset] = contextvars.ContextVar("skipped", default=frozenset())


@contextlib.contextmanager
def skipping(names: Iterable[str]):
    """Switch rules (or out-of-scope entries) off inside the block. For gas_lab.measure.unsafe only."""
    token = _SKIPPED.set(_SKIPPED.get() | frozenset(names))
    try:
        yield
    finally:
        _SKIPPED.reset(token)


def first_violation(situation: Situation, entries: Iterable = RULES) -> Rule | OutOfScope | None:
    """The first of ``entries`` that fires for this situation, skipped ones left out."""
    skipped = _SKIPPED.get()
    for rule in entries:
        if rule.name not in skipped and rule.action == situation.action and rule.applies(situation):
            return rule
    return None


def enforce(situation: Situation) -> None:
    """Raise for the first rule, then the first out-of-scope entry, that applies now.

    Rules are matched by ``situation.action``: which call is happening (``"initialize"``,
    ``"step"``, entering ``"no_sync"``, ...).
    """
    rule = first_violation(situation, RULES)
    if rule is not None:
        raise RejectedCombination.of(rule)
    item = first_violation(situation, OUT_OF_SCOPE)
    if item is not None:
        raise NotImplementedInGasLab(f"{item.condition} is out of gas_lab's scope. {item.pointer}")


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
    """Every refusal as a row (for the docs page)."""
    return [
        {
            "rule": r.name,
            "when": r.moment,
            "condition": r.condition,
            "why": r.reason,
            "silent failure it prevents": r.prevents,
            "DeepSpeed raises": f"{r.deepspeed_raises}: {r.deepspeed_message}",
            "gas_lab": r.gas_lab,
        }
        for r in ALL_RULES
    ]


def table_markdown(rows: list[dict] | None = None) -> str:
    """:func:`table` as a markdown table."""
    rows = table() if rows is None else rows
    cols = list(rows[0])

    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows])
