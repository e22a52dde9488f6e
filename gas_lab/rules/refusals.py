"""The combinations DeepSpeed refuses, gathered once, as data, and :func:`enforce`.

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

The rules are written by topic: :mod:`~gas_lab.rules.config_refusals` (at ``initialize``),
:mod:`~gas_lab.rules.call_refusals` (a method or a with-block) and
:mod:`~gas_lab.rules.idle_rank_refusals` (a rank with nothing to reduce); what a rule is,
:mod:`~gas_lab.rules.rule`. This module gathers them:

* :data:`RULES`: the refusals gas_lab enforces itself, at the same moment as DeepSpeed
  (the config and the engine of :mod:`gas_lab.deepspeed_compat` call :func:`enforce`).
* :data:`DEEPSPEED_ONLY`: refusals DeepSpeed makes where gas_lab stops earlier (ZeRO-3, fp16
  are out of scope); kept for the table and for ``gas_lab.measure.prediction.predict``.
* :data:`OUT_OF_SCOPE` (:mod:`~gas_lab.rules.out_of_scope`): what DeepSpeed accepts but gas_lab
  does not teach: those raise :class:`NotImplementedInGasLab`, which points you to
  ``deepspeed.initialize``.

Next door: ``gas_lab/measure/prediction.py`` evaluates these rules on a config and a script of engine
calls and holds the measured matrix they are checked against; ``gas_lab/rules/traps.py`` lists what
DeepSpeed *accepts* that still trains wrong.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Iterable

from gas_lab.errors import NotImplementedInGasLab, RejectedCombination
from gas_lab.rules.call_refusals import CALL_REFUSALS
from gas_lab.rules.config_refusals import CONFIG_REFUSALS
from gas_lab.rules.idle_rank_refusals import IDLE_RANK_REFUSALS
from gas_lab.rules.operations import ACTIONS
from gas_lab.rules.out_of_scope import OUT_OF_SCOPE
from gas_lab.rules.rule import SAME, OutOfScope, Rule, Situation, register

# Imported from here by lessons, solutions and tests (a redundant alias re-exports, for ruff).
from gas_lab.rules.rule import Example as Example
from gas_lab.rules.rule import rule_named as rule_named

# Grouped by the call they are checked at, then in the order DeepSpeed checks them.
ALL_RULES: list[Rule] = sorted(
    CONFIG_REFUSALS + CALL_REFUSALS + IDLE_RANK_REFUSALS,
    key=lambda r: (ACTIONS.index(r.action), r.order),
)
RULES: list[Rule] = [r for r in ALL_RULES if r.gas_lab == SAME]
DEEPSPEED_ONLY: list[Rule] = [r for r in ALL_RULES if r.gas_lab != SAME]
register(ALL_RULES)  # found by name (rule_named), and so pickled by name

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
