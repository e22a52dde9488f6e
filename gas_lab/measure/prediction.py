"""What DeepSpeed does with a config and a script of engine calls, predicted from the rules.

``python -m gas_lab.measure.matrix`` ran DeepSpeed 0.19.8 on 2 CPU ranks for every combination
that matters and wrote down what happened: accepted, or which exception at which call. That file is
:func:`measured_matrix`. :func:`predict` answers the same question from the data in
``gas_lab/rules/refusals.py`` alone, walking the same script of calls; ``tests/test_rules.py`` checks
that the two agree on every measured case, so the rules are known to be complete::

    rule, op = predict(config, ["enter_no_sync", "backward", "step"])
    rule.name, op    # ("step_in_no_sync", "step"); (None, None) when DeepSpeed runs it
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Sequence
from pathlib import Path

from gas_lab.deepspeed_compat.config import ConfigError, parse
from gas_lab.engine import is_boundary
from gas_lab.measure import matrix
from gas_lab.rules.operations import situation_action
from gas_lab.rules.refusals import ALL_RULES, Rule, Situation, first_violation


def predict(
    config: dict, ops: Sequence[str] = (), pipeline: bool = False
) -> tuple[Rule | None, str | None]:
    """What DeepSpeed 0.19.8 does (on the CPU accelerator, as measured), from the rules data
    alone: ``(rule, op)`` for the first refusal (``op`` is "initialize" or one of ``ops``, the
    ops of :mod:`gas_lab.rules.operations`), or ``(None, None)`` if it runs.

    Raises ``config.ConfigError`` for configs gas_lab refuses to parse (DeepSpeed is more
    lenient: it ignores unknown keys and takes ``"no"`` for true).
    """
    cfg = parse(config)
    inside = False  # inside no_sync() or coalesce_grad_reduction(): both suspend the reduction
    idle, micro, override = True, 0, None  # no backward() since the last update; micro-steps
    reduced = False  # managed: the boundary micro-step's backward() reduced since the last update
    managed = cfg.managed_gradient_accumulation
    for op in ("initialize", *ops):
        action = situation_action(op)
        gas = cfg.gradient_accumulation_steps or 1
        boundary = override if override is not None else is_boundary(micro, gas)
        update = op == "step" and (not managed or boundary)
        situation = Situation(
            cfg,
            action,
            inside,
            pipeline,
            idle and update,
            no_boundary_backward=update and managed and not reduced,
        )
        rule = first_violation(situation, ALL_RULES)
        if rule is not None:
            return rule, op
        if op in ("backward", "tensor_backward", "train_batch", "exit_coalesce"):
            idle = False  # leaving coalesce_grad_reduction() reduces, even nothing
            reduced = reduced or op == "exit_coalesce" or (boundary and not inside)
        elif op == "step":
            idle, micro = idle or update, micro + 1
            reduced = reduced and not update
        elif op.startswith("set_boundary_"):
            override = op == "set_boundary_true"
        if op in ("enter_no_sync", "enter_coalesce"):
            inside = True
        elif op in ("exit_no_sync", "exit_coalesce"):
            inside = False
    return None, None


def measured_matrix(path: str | Path | None = None) -> dict:
    """The matrix measured on the installed DeepSpeed version (``data/`` in the repository)."""
    if path is None:
        version = importlib.metadata.version("deepspeed")  # without importing it (slow)
        path = matrix.DATA / f"deepspeed_{version}_matrix.json"
    return json.loads(Path(path).read_text())


def disagreements(measured: dict | None = None) -> tuple[list[str], list[str]]:
    """Check :func:`predict` against every case of the measured matrix: one line per case it
    predicts wrongly (outcome, moment or call), and the ids of the configs gas_lab refuses to
    parse on purpose, where DeepSpeed is lenient (those are not predicted)."""
    measured = measured_matrix() if measured is None else measured
    wrong, unparsed = [], []
    for case in measured["cases"]:
        try:
            rule, op = predict(case["config"], case["ops"], case["pipeline"])
        except ConfigError:
            unparsed.append(case["id"])
            continue
        predicted = ("accepted", None, None) if rule is None else ("rejected", rule.moment, op)
        if predicted != (case["outcome"], case["moment"], case["raised_in"]):
            wrong.append(
                f"{case['id']}: predicted {predicted}, measured "
                f"{(case['outcome'], case['moment'], case['raised_in'])}"
            )
    return wrong, unparsed
