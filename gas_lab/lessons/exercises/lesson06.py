"""Checkers for lesson 06 (rejected combinations, and the ones accepted but silently wrong).

Exercise 1 asks for a prediction per scenario: "accepted", "rejected" or "silently wrong". The
answer key is not typed in here: it comes from the rules data (:func:`gas_lab.rules.prediction.predict`,
checked against DeepSpeed's measured matrix) and the traps (:data:`gas_lab.rules.traps.TRAPS`, each
measured on DeepSpeed in the lesson). Exercise 2 asks for the initialize-time rules as code and
grades it against every relevant case of the measured matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gas_lab.lessons.exercises.verdict import Verdict, check_cases
from gas_lab.rules import prediction, traps
from gas_lab.rules.traps import Loop

ANSWERS = ("accepted", "rejected", "silently wrong")
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
}


@dataclass(frozen=True)
class Scenario:
    """A config and a loop, as a learner reads them; ``ops``/``loop`` feed the answer key."""

    config: dict
    loop: str  # the loop in words
    ops: tuple[str, ...] = ("backward", "step")
    facts: Loop = Loop()

    def show(self) -> str:
        extra = {k: v for k, v in self.config.items() if BASE.get(k) != v}
        return f"config: base + {extra}\n    loop: {self.loop}"


_NO_FACTS = Loop()


def _s(loop: str, ops=("backward", "step"), facts=_NO_FACTS, **config) -> Scenario:
    return Scenario({**BASE, **config}, loop, tuple(ops), facts)


_UNMANAGED = {"managed_gradient_accumulation": False}
SCENARIOS: dict[str, Scenario] = {
    "A": _s("3 x engine.backward(loss), then engine.step()", ["backward"] * 3 + ["step"],
            Loop((3, 3)), zero_optimization={"stage": 1, "overlap_comm": True}, **_UNMANAGED),
    "B": _s("2 x engine.backward(loss), then engine.step()", ["backward"] * 2 + ["step"],
            Loop((2, 2)), zero_optimization={"stage": 3, "overlap_comm": True}, **_UNMANAGED),
    "C": _s("3 x engine.backward(loss), then engine.step() (every rank)",
            ["backward"] * 3 + ["step"], Loop((3, 3)), **_UNMANAGED),
    "D": _s('same loop as C, the flag written as the string "false"', ["backward"] * 3 + ["step"],
            Loop((3, 3)), managed_gradient_accumulation="false"),
    "E": _s("set_gradient_accumulation_boundary(True) before the last of 2 backward(), then step()",
            ["backward", "set_boundary_true", "backward", "step"], Loop((2, 2)), **_UNMANAGED),
    "F": _s("rank 0 runs 1 micro-batch, rank 1 runs 2; each loss * W / (N summed over ranks), "
            "engine.backward(loss, scale_wrt_gas=False), then step()", ["backward", "step"],
            Loop((1, 2), scale_wrt_gas=False, loss_divisor="global"),
            zero_optimization={"stage": 1}, **_UNMANAGED),
    "G": _s("2 x loss.backward() (not engine.backward), then engine.step()",
            ["tensor_backward"] * 2 + ["step"], Loop((2, 2), backward="tensor"),
            zero_optimization={"stage": 1}, **_UNMANAGED),
    "H": _s('managed; an "amp": {"enabled": false} block left over from an old config',
            ["backward", "step", "backward", "step"], amp={"enabled": False}),
}  # fmt: skip


def expected(s: Scenario) -> tuple[str, str]:
    """``(answer, why)`` from the rules data: rejected by a rule, caught by a trap, or neither."""
    flag = [t for t in traps.traps(s.config, s.facts) if t.name == "managed_flag_not_false"]
    if flag:  # gas_lab refuses to parse such a config; DeepSpeed runs it, silently managed
        return "silently wrong", f"{flag[0].symptom} Rule: {flag[0].fix}."
    rule, op = prediction.predict(s.config, s.ops)
    if rule is not None:
        where = op if op == "initialize" else f"{prediction.OP_ACTIONS.get(op, op)}()"
        return "rejected", (
            f"rule {rule.name}: DeepSpeed raises {rule.deepspeed_raises} at {where}. {rule.reason}"
        )
    caught = traps.traps(s.config, s.facts)
    if caught:
        return "silently wrong", f"{caught[0].symptom} Rule: {caught[0].fix}."
    return "accepted", "it runs, and nothing known goes wrong."


def _prediction_case(fn: Callable, letter: str):
    def run():
        answers = fn()
        if not isinstance(answers, dict):
            raise TypeError(f"return a dict like {{'A': 'rejected', ...}}, got {type(answers)}")
        return answers.get(letter)

    def judge(got) -> str | None:
        answer, why = expected(SCENARIOS[letter])
        if got not in ANSWERS:
            return f"answer one of {ANSWERS}, got {got!r}."
        return None if got == answer else f"you said {got!r}; it is {answer!r}: {why}"

    return (f"scenario {letter}", run, judge)


def check_predictions(fn: Callable[[], dict]) -> Verdict:
    """Exercise 1: ``fn()`` returns ``{"A": "accepted" | "rejected" | "silently wrong", ...}``."""
    return check_cases(
        "predict: accepted, rejected or silently wrong",
        [_prediction_case(fn, letter) for letter in SCENARIOS],
        "rejections are about boundary-gated work in backward() or a second owner of the "
        "boundary; silent traps are about scaling, counting and DeepSpeed's lenient parsing.",
    )


# ---------------------------------------------------------------- exercise 2: rules as code
def initialize_cases() -> list[dict]:
    """The measured cases whose fate is decided by the config alone (fp32, no offload)."""
    out = []
    for case in prediction.measured_matrix()["cases"]:
        axes = case["axes"]
        grid = case["group"] == "grid" and axes["precision"] == "fp32" and axes["offload"] == "none"
        config = case["group"] == "config" and axes["check"] in ("sgd_untested", "max_grad_norm")
        if grid or config or case["group"] in ("amp", "deepcompile"):
            out.append(case)
    return out


def _refusal_case(fn: Callable, case: dict):
    refused = case["outcome"] == "rejected" and case["moment"] == "initialize"

    def judge(got) -> str | None:
        if not isinstance(got, bool):
            return f"return True or False, got {got!r}."
        if got == refused:
            return None
        if refused:
            return (
                f"DeepSpeed {prediction.measured_matrix()['deepspeed_version']} refuses it "
                f"(measured: {case['exception']}: {case['message'][:90]}), your function accepts."
            )
        return "DeepSpeed accepts it (measured), your function refuses it."

    return (case["id"], lambda: fn(case["config"]), judge)


def check_refusal_rules(fn: Callable[[dict], bool]) -> Verdict:
    """Exercise 2: ``fn(config)`` says whether DeepSpeed refuses the config at initialize."""
    return check_cases(
        "DeepSpeed's initialize-time refusals, as code",
        [_refusal_case(fn, c) for c in initialize_cases()],
        "five rules decide these cases: look at the table's 'initialize' rows, and at which "
        "ZeRO stages the measured matrix (not the message) says overlap_comm is refused.",
    )
