"""Checkers for lesson 03 (managed accumulation: the engine counts).

Each checker builds a fresh gas_lab engine in this process (world size 1, SGD, no clipping, so
a wrong scale shows up as a wrong step size), runs the learner's loop on ``parity``'s data, and
compares with the plain-PyTorch reference ``pitfalls.reference_params``. Judges recognise the
classic mistakes by running them too and comparing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gas_lab.engine import initialize
from gas_lab.lessons.exercises.verdict import Verdict, check_cases
from gas_lab.lessons.toys import flat_params, micro_batch, tiny_model
from gas_lab.measure.parity import reference_params

TOL = 1e-6
LR = 0.1
MICRO = 2


def sgd_config(gas: int, lr: float = LR, managed: bool = True) -> dict:
    """A small config whose mistakes are visible: SGD (a step is lr x gradient), no clipping."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "managed_gradient_accumulation": managed,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
    }


def new_engine(config: dict):
    model = tiny_model(0)
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def windows(ns: list[int]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The micro-batches of each optimizer step: step i has ns[i] of them."""
    return [[micro_batch(0, step, m, 0, MICRO) for m in range(n)] for step, n in enumerate(ns)]


def counters(engine) -> tuple[int, int, int]:
    return engine.global_steps, engine.global_samples, engine.micro_steps


def mse(prediction: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(prediction, y)


def run_windows(fn: Callable, config: dict, ns: list[int]) -> dict:
    """Call ``fn(engine, micro_batches, loss_fn)`` once per window on a fresh engine."""
    engine = new_engine(config)
    for micro_batches in windows(ns):
        fn(engine, micro_batches, mse)
    return {"params": flat_params(engine.module), "counters": counters(engine)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= TOL


# ---------------------------------------------------------------- exercise 1: the boundary
def check_boundary_steps(fn: Callable) -> Verdict:
    """Exercise 1: ``fn(gas, calls)`` says, for each of ``calls`` step() calls, whether it
    applies an optimizer update."""

    def case(gas: int, calls: int):
        def run():
            engine = new_engine(sgd_config(gas))
            truth = []
            for k in range(calls):
                x, y = micro_batch(0, 0, k, 0, MICRO)
                engine.backward(mse(engine(x), y))
                engine.step()
                truth.append(engine.was_step_applied())
            return gas, [bool(b) for b in fn(gas, calls)], truth

        return run

    def judge(result) -> str | None:
        gas, got, truth = result
        if got == truth:
            return None
        shown = "".join("U" if b else "." for b in got)
        want = "".join("U" if b else "." for b in truth)
        if got and got[0] and gas > 1:
            return (
                f"got {shown}, expected {want} (U = update): your first update is at call 1. "
                "The engine tests (micro_steps + 1) % GAS before step() adds 1 to micro_steps, "
                "so the first update is the GAS-th call."
            )
        return f"got {shown}, expected {want} (U = update, one character per step() call)."

    return check_cases(
        "which step() calls update",
        [(f"GAS {g}, {c} calls", case(g, c), judge) for g, c in ((1, 3), (3, 7), (4, 9))],
        "call k (counting from 1) updates when k % GAS == 0.",
    )


# ---------------------------------------------------------------- exercise 2: symmetric loop
def _default_scaled_twice(engine, micro_batches, loss_fn):
    for x, y in micro_batches:  # the mistake: / N by hand AND / GAS by the engine
        engine.backward(loss_fn(engine(x), y) / len(micro_batches))
        engine.step()


def check_managed_loop(fn: Callable) -> Verdict:
    """Exercise 2: ``fn(engine, micro_batches, loss_fn)`` runs one window through a managed
    engine (GAS = len(micro_batches)) with forward, backward and step on every micro-batch."""

    def case(gas: int, steps: int):
        def run():
            return gas, steps, run_windows(fn, sgd_config(gas), [gas] * steps)

        return run

    def judge(result) -> str | None:
        gas, steps, got = result
        n_steps, _, micro_steps = got["counters"]
        if micro_steps != gas * steps:
            return (
                f"micro_steps is {micro_steps} after {steps} windows of {gas}, expected "
                f"{gas * steps}: a managed engine counts step() calls, so call step() after "
                "every backward()."
            )
        if n_steps != steps:
            return f"{n_steps} optimizer updates in {steps} windows, expected {steps}."
        ref = reference_params(sgd_config(gas), steps, world_size=1)
        if _close(got["params"], ref):
            return None
        if _close(got["params"], reference_params(sgd_config(gas, LR / gas), steps, world_size=1)):
            return (
                f"the update is {gas}x too small: engine.backward(loss) already divides by GAS "
                "(scale_wrt_gas=True); do not divide again."
            )
        if _close(got["params"], reference_params(sgd_config(gas, LR * gas), steps, world_size=1)):
            return (
                f"the update is {gas}x too large: nothing divided the loss by GAS. Call "
                "engine.backward(loss) with the default scale_wrt_gas=True."
            )
        return f"parameters are {(got['params'] - ref).abs().max().item():.2g} from the reference."

    return check_cases(
        "the symmetric managed loop",
        [(f"GAS {g}, {s} windows", case(g, s), judge) for g, s in ((1, 2), (3, 2))],
        "for x, y in micro_batches: loss = loss_fn(engine(x), y); engine.backward(loss); "
        "engine.step()",
    )


# ---------------------------------------------------------------- exercise 3: the override
def _override_default_scale(engine, micro_batches, loss_fn):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        engine.set_gradient_accumulation_boundary(i == n - 1)
        engine.backward(loss_fn(engine(x), y))  # the mistake: / GAS, not / N
    engine.step()


def check_variable_window(fn: Callable) -> Verdict:
    """Exercise 3: ``fn(engine, micro_batches, loss_fn)``: one update over ANY number of
    micro-batches on a managed engine, with set_gradient_accumulation_boundary()."""

    def case(gas: int, ns: list[int]):
        def run():
            return gas, ns, run_windows(fn, sgd_config(gas), ns)

        return run

    def judge(result) -> str | None:
        gas, ns, got = result
        n_steps = got["counters"][0]
        if n_steps == 0:
            return (
                "no update happened: set the boundary to True before the LAST micro-batch's "
                "backward(), then call step()."
            )
        if n_steps != len(ns):
            return (
                f"{n_steps} updates for {len(ns)} windows {ns}: the boundary must be False "
                "for every micro-batch but the last, and step() called once per window."
            )
        ref = reference_params(sgd_config(gas), len(ns), ns, world_size=1)
        if _close(got["params"], ref):
            return None
        wrong = run_windows(_override_default_scale, sgd_config(gas), ns)["params"]
        if _close(got["params"], wrong):
            return (
                f"each loss was divided by GAS = {gas}, not by the window's N ({ns}): pass "
                "scale_wrt_gas=False and divide by N yourself."
            )
        return f"parameters are {(got['params'] - ref).abs().max().item():.2g} from the reference."

    return check_cases(
        "a variable window on a managed engine",
        [
            (f"GAS {g}, windows of {ns} micro-batches", case(g, ns), judge)
            for g, ns in ((2, [3, 1, 2]), (4, [1, 4, 6]))
        ],
        "for each micro-batch: set_gradient_accumulation_boundary(i == N - 1), then "
        "engine.backward(loss / N, scale_wrt_gas=False); after the window, one engine.step().",
    )
