"""Checkers for lesson 06's exercises (rejected combinations).

1. :func:`check_predictions`: eight combinations the lesson did not run, each a stage or a mode
   away from one it did. Predict what DeepSpeed does: accept, or raise at which call. The
   checker measures every scenario *now*, on real DeepSpeed on the notebook's ranks (the same
   code as ``python -m gas_lab.measure.matrix``).
2. :func:`check_new_rule`: a combination the committed matrix never measured, pipeline
   parallelism with ZeRO stage 2 or 3. Write DeepSpeed's refusal as a :class:`Rule`; the
   checker measures the new cases live and runs ``gas_lab.measure.prediction`` with your rule
   added over them *and* over every committed case, which must all still come out right.

Both take the notebook's ``cluster``. A first wrong try says what differs and where to look;
the fix comes on a second wrong try of the same case, or from ``lesson06.hint()``.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

from gas_lab.deepspeed_compat.config import ConfigError, parse
from gas_lab.lessons.exercises import verdict
from gas_lab.lessons.exercises.on_ranks import measured_once
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # lessonNN.hint()
from gas_lab.measure import matrix, prediction
from gas_lab.rules.operations import ACTIONS, call_of, situation_action
from gas_lab.rules.refusals import Rule, Situation, first_violation

#: What a learner may answer: "accepted", or the engine call that raises (gas_lab.rules.operations).
ANSWERS = ("accepted", *ACTIONS)
# letter -> (a case of the measured matrix the lesson did not run, why DeepSpeed does what it
# does: the fix a second wrong try shows)
SCENARIOS = {
    "A": ("grid/stage=1/managed=False/overlap_comm=True/offload=cpu/precision=bf16",
          "unmanaged_overlap_comm reads the stage, the mode and overlap_comm only: CPU offload "
          "and bf16 change nothing, so initialize refuses it."),
    "B": ("api/stage=1/managed=True/api=step_in_no_sync",
          "step_in_no_sync holds in both modes and at every stage: step() updates from reduced "
          "gradients, and no_sync() promised none."),
    "C": ("api/stage=1/managed=False/api=no_sync",
          "no rule refuses no_sync() unmanaged at stage 0/1: there backward() only accumulates "
          "anyway, and step() reduces after the block."),
    "D": ("api/stage=0/managed=True/api=set_boundary_false",
          "unmanaged_set_boundary is about unmanaged mode: managed, the counter owns the "
          "boundary and may be overridden."),
    "E": ("api/stage=1/managed=False/api=tensor_backward",
          "tensor_backward_stage0 applies at stage 0 only: from stage 1 the ZeRO optimizer's "
          "gradient hooks see a direct loss.backward() end."),
    "F": ("api/stage=1/managed=True/api=coalesce",
          "managed ZeRO-1 is what coalesce_grad_reduction() is for: no rule holds."),
    "G": ("api/stage=1/managed=False/api=coalesce",
          "unmanaged_coalesce holds at every stage, checked on entering the block: step() "
          "already defers the reduction."),
    "H": ("api/stage=2/managed=False/api=no_sync",
          "no_sync_stage23: at ZeRO-2/3 every backward() reduces, in either mode, so entering "
          "no_sync() is refused."),
}  # fmt: skip
WHERE_1 = "section 3 (*The rules this lesson takes apart*), and the idea in section 1"


def _committed() -> dict[str, dict]:
    return {c["id"]: c for c in prediction.measured_matrix()["cases"]}


def describe(case: dict) -> str:
    """A case as a learner reads it: what differs from the matrix's base config, then the calls."""
    extra = {k: v for k, v in case["config"].items() if matrix.BASE.get(k) != v}
    calls = ", ".join(call_of(op).label for op in case["ops"])
    pipe = " a PipelineModule model," if case["pipeline"] else ""
    return f"base + {extra};{pipe} then: {calls}"


def scenarios() -> str:
    """Exercise 1's scenarios as a learner reads them, one line each."""
    cases = _committed()
    lines = [f"base: {matrix.BASE}"]
    lines += [f"{letter}. {describe(cases[case_id])}" for letter, (case_id, _) in SCENARIOS.items()]
    return "\n".join(lines)


def _measure_quietly(cases: list[dict]) -> list[dict]:
    """On a rank: ``matrix.measure``, without DeepSpeed's start-up chatter (pipelines print)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return matrix.measure(cases)


def measure_live(cases: list[dict], cluster) -> list[dict]:
    """What DeepSpeed does with ``cases`` now, on the notebook's ranks (rank 0's record; each
    case measured once per session)."""
    key = ("lesson06 matrix", tuple(c["id"] for c in cases), cluster.world_size)
    return measured_once(key, lambda: cluster.run(_measure_quietly, cases, timeout=300)[0])


def _said(got: dict) -> str:
    if got["outcome"] == "accepted":
        return "accepted"
    return f"{got['exception']} at {call_of(got['raised_in']).call}(): {got['message'][:100]}"


# ---------------------------------------------------------------- exercise 1: predict, measured
def _judge_prediction(letter: str, answer, got: dict) -> str | Miss | None:
    if answer not in ANSWERS:
        return f"answer one of {ANSWERS}, got {answer!r}."
    truth = "accepted" if got["outcome"] == "accepted" else call_of(got["raised_in"]).call
    if answer == truth:
        return None
    if truth == "accepted":
        measured = "DeepSpeed, measured now, accepts it"
    elif answer == "accepted":
        measured = "DeepSpeed, measured now, refuses it"
    else:
        measured = f"DeepSpeed, measured now, refuses it, but not at {answer}()"
    return Miss(f"you predicted {answer!r}; {measured}.", SCENARIOS[letter][1])


def check_predictions(fn: Callable[[], dict], cluster) -> Verdict:
    """Exercise 1: ``fn()`` returns ``{"A": answer, ...}``, an answer being "accepted" or the
    call DeepSpeed raises at ("initialize", "step", "no_sync", ... :data:`ANSWERS`)."""
    return verdict.check_predictions(
        "predict the matrix, then measure it",
        fn,
        SCENARIOS,
        lambda letter: measure_live([_committed()[SCENARIOS[letter][0]]], cluster)[0],
        _judge_prediction,
        case="scenario",
        example="{'A': 'accepted', ...}",
        hint="a rule fires at its own call (initialize, a method, or entering a with-block), and "
        "only when its condition holds for THIS stage and mode; the first call of the script "
        "that meets one raises. No rule holds: accepted.",
        where=WHERE_1,
        module=__name__,
    )


# ---------------------------------------------------------------- exercise 2: a rule for a new case
def new_cases() -> list[dict]:
    """Pipeline parallelism at ZeRO stage 2 and 3, managed and unmanaged: not in the matrix."""
    out = []
    for stage in (2, 3):
        for managed in (True, False):
            config = {
                **matrix.BASE,
                "managed_gradient_accumulation": managed,
                "zero_optimization": {"stage": stage},
            }
            axes = {"stage": stage, "managed": managed}
            out.append(
                {
                    "id": f"pipeline/stage={stage}/managed={managed}",
                    "group": "pipeline",
                    "axes": axes,
                    "config": config,
                    "ops": ["train_batch"],
                    "pipeline": True,
                }
            )
    return out


def predict_with(rule: Rule, case: dict) -> tuple[Rule | None, str | None]:
    """``prediction.predict`` with ``rule`` added after the known rules (where two apply, the
    known one fires first)."""
    known, op = prediction.predict(case["config"], case["ops"], case["pipeline"])
    if known is not None:
        return known, op
    config = parse(case["config"])
    for op in ("initialize", *case["ops"]):
        if first_violation(
            Situation(config, situation_action(op), False, case["pipeline"]), [rule]
        ):
            return rule, op
    return None, None


def _compare(rule: Rule, case: dict, got: dict) -> Miss | None:
    """None if the rules (with ``rule``) predict what DeepSpeed did with ``case``; else what
    differs, and the fix for that mistake."""
    try:
        fired, op = predict_with(rule, case)
    except Exception as err:  # the learner's applies() may raise on a config it did not expect
        return Miss(
            f"{case['id']}: your rule's applies() raised {type(err).__name__}: {err}.",
            "applies(s) reads s.pipeline (a bool) and s.config.zero_optimization.stage (an int); "
            "it must answer for every config, pipelines or not.",
        )
    if got["outcome"] == "accepted":
        if fired is None:
            return None
        return Miss(
            f"{case['id']}: DeepSpeed accepts it (measured), your rules refuse it ({fired.name}).",
            "applies() holds for too much: which stages does DeepSpeed refuse with a pipeline?",
        )
    if fired is None:
        return Miss(
            f"{case['id']}: DeepSpeed raises {got['exception']} at "
            f"{call_of(got['raised_in']).call}(); your rules accept it.",
            "applies() holds for too little: read the stages of every new case that DeepSpeed "
            "refuses.",
        )
    if op != got["raised_in"] or fired.moment != got["moment"]:
        return Miss(
            f"{case['id']}: DeepSpeed raises at {call_of(got['raised_in']).call} (moment "
            f"{got['moment']!r}); {fired.name} fires at {call_of(op).call} (moment "
            f"{fired.moment!r}).",
            "action and moment name the call that raises: here DeepSpeed raises before any "
            "train_batch(), inside deepspeed.initialize.",
        )
    if fired.deepspeed_raises != got["exception"]:
        return Miss(
            f"{case['id']}: DeepSpeed raises {got['exception']}, {fired.name} says "
            f"{fired.deepspeed_raises}.",
            "deepspeed_raises is the exception's type name, as lesson06.measure_live prints it.",
        )
    if not fired.deepspeed_message or not got["message"].startswith(fired.deepspeed_message):
        return Miss(
            f"{case['id']}: DeepSpeed's message does not start with {fired.name}'s "
            f"deepspeed_message {fired.deepspeed_message!r}.",
            "deepspeed_message is the first words of the message, exactly as "
            "lesson06.measure_live prints it (a prefix: tests check the message still starts "
            "so).",
        )
    return None


def check_new_rule(fn: Callable[[], Rule], cluster) -> Verdict:
    """Exercise 2: ``fn()`` returns the :class:`Rule` DeepSpeed enforces for pipeline
    parallelism at ZeRO stage 2/3, checked against those cases measured now and against every
    case of the committed matrix."""
    state: dict = {}

    def the_rule() -> Rule:
        if "rule" not in state:
            rule = fn()  # first: an untouched TODO raises here, before anything is measured
            if not isinstance(rule, Rule):
                raise TypeError(f"return a gas_lab.rules.refusals.Rule, got {type(rule).__name__}")
            state["rule"] = rule
        return state["rule"]

    def new(case: dict):
        def run():
            rule = the_rule()
            return _compare(rule, case, measure_live([case], cluster)[0])

        return (f"new: {case['id']}, measured now", run, lambda problem: problem)

    def committed():
        rule = the_rule()
        for case in _committed().values():
            try:
                parse(case["config"])
            except ConfigError:  # gas_lab refuses DeepSpeed's lenient parsing: not a rule case
                continue
            problem = _compare(rule, case, case)
            if problem is not None:
                return problem
        return None

    cases = [new(c) for c in new_cases()]
    cases.append(("every case of the committed matrix", committed, lambda problem: problem))
    return check_cases(
        "a rule for pipelines at ZeRO-2/3",
        cases,
        "measure first: lesson06.measure_live(lesson06.new_cases(), cluster) shows each "
        "exception, its message and the op that raised. Then Rule(..., action='initialize', "
        "moment='initialize', deepspeed_raises=<the type>, deepspeed_message=<the message's "
        "start>, applies=lambda s: ...), reading s.pipeline and s.config.zero_optimization.stage.",
        where="section 3 (*The rules this lesson takes apart*) for a Rule's fields, and what "
        "lesson06.measure_live(lesson06.new_cases(), cluster) prints",
    )
