"""What a refusal is: :class:`Rule` (and :class:`OutOfScope`), the :class:`Situation` it looks
at, the :class:`Example` that triggers it, and the registry that finds a rule by its name.

The rules themselves are data, by topic, next door: ``config_refusals`` (the config, at
``initialize``), ``call_refusals`` (an engine call or a with-block), ``idle_rank_refusals`` (a
rank with nothing to reduce, appendix A3) and ``out_of_scope``. :mod:`gas_lab.rules.refusals`
gathers them in the order DeepSpeed checks them, registers them here, and enforces them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

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
        # pickle: a registered rule travels by name, any other without its condition.
        if _REGISTERED.get(self.name) == self:
            return rule_named, (self.name,)
        fields = {k: v for k, v in vars(self).items() if k != "applies"}
        return _rule_from_fields, (fields,)


# Every rule of gas_lab.rules.refusals.ALL_RULES, by name: refusals registers them. Importing
# this module imports the package gas_lab.rules first, whose __init__ imports refusals, so a
# rule unpickled on the other side of a pipe is found here before anyone asks.
_REGISTERED: dict[str, Rule] = {}


def register(rules: Iterable[Rule]) -> None:
    """Make ``rules`` findable by :func:`rule_named` (and so pickled by name)."""
    _REGISTERED.update((rule.name, rule) for rule in rules)


def rule_named(name: str) -> Rule:
    """The rule of :data:`gas_lab.rules.refusals.ALL_RULES` called ``name``."""
    return _REGISTERED[name]


def _rule_from_fields(fields: dict) -> Rule:
    return Rule(**fields)


@dataclass(frozen=True)
class OutOfScope:
    """Something DeepSpeed accepts that gas_lab leaves out; ``pointer`` says where to go."""

    name: str
    action: str
    condition: str
    pointer: str  # where to go instead
    applies: Callable[[Situation], bool] = field(repr=False, compare=False, default=None)


# What the rules' conditions ask of a situation, and what their examples and keys say.
def is_unmanaged(s: Situation) -> bool:
    return not s.config.managed_gradient_accumulation


def zero_stage(s: Situation) -> int:
    return s.config.zero_optimization.stage


def in_no_sync(s: Situation) -> bool:
    return s.inside_no_sync


UNMANAGED = {"managed_gradient_accumulation": False}
MGA = "managed_gradient_accumulation=false"
