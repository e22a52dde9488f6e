"""Checkers for lesson 03's exercises (managed accumulation: the engine counts).

1. :func:`check_counter_predictions`: predict ``(micro_steps, global_steps, global_samples)``
   after scripts of engine calls the lesson did not run; the checker runs each script on real
   DeepSpeed on the notebook's ranks and compares (pass ``cluster``).
2. :func:`check_epochs`: epochs whose length is not a multiple of GAS, one update per window
   and one for each epoch's remainder, run twice on the same engine; the checker records after
   which micro-batch every update happened, on a one-process gas_lab engine (the lesson
   asserts it counts like DeepSpeed), and compares the parameters with plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gas_lab.deepspeed_compat.engine import initialize
from gas_lab.lessons.exercises.on_ranks import measured_once
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases, check_predictions
from gas_lab.lessons.exercises.verdict import hint as hint  # lessonNN.hint()
from gas_lab.measure.parity import reference_params
from gas_lab.toys import flat_params, micro_batch, tiny_model

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
        "steps_per_print": 10**9,
    }


def mse(prediction: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(prediction, y)


# ---------------------------------------------------------------- exercise 1: predict the counters
@dataclass(frozen=True)
class Script:
    """Engine calls after ``initialize``: ``parts`` is ``(repeat, ops)`` pairs, in order."""

    gas: int
    parts: tuple[tuple[int, tuple[str, ...]], ...]
    why: str  # what decides the answer, shown once the prediction has been checked

    @property
    def ops(self) -> list[str]:
        return [op for repeat, ops in self.parts for _ in range(repeat) for op in ops]

    def show(self) -> str:
        def one(repeat, ops):
            calls = ", ".join(_CALL.get(op, f"{op}()") for op in ops)
            return calls if repeat == 1 else f"{repeat} x ({calls})"

        return f"GAS {self.gas}: " + "; ".join(one(*part) for part in self.parts)


_CALL = {
    "boundary=True": "set_gradient_accumulation_boundary(True)",
    "boundary=False": "set_gradient_accumulation_boundary(False)",
    "boundary=None": "set_gradient_accumulation_boundary(None)",
}
_BS = ("backward", "step")
SCRIPTS = {
    "A": Script(4, ((10, _BS),), "the counter alone: boundaries at the 4th and 8th step() call."),
    "B": Script(
        4,
        ((3, _BS), (1, ("boundary=True",)), (1, _BS), (1, ("boundary=None",)), (4, _BS)),
        "True makes the 4th call a boundary; None hands the boundary back to the counter, which "
        "kept counting (micro_steps is 4), so the next boundary is the 8th call.",
    ),
    "C": Script(
        4,
        ((1, ("boundary=False",)), (6, _BS), (1, ("boundary=None",)), (2, _BS)),
        "False holds every boundary back, even the 4th call; after None the counter's next "
        "boundary is the 8th call, which updates once from all 8 micro-batches.",
    ),
    "D": Script(
        4,
        ((5, ("backward",)), (1, ("step",))),
        "an unmanaged loop on a managed engine: one step() call is 1 micro-step, not a boundary.",
    ),
    "E": Script(
        4,
        ((4, ("backward", "step", "step")),),
        "every step() call counts, with or without a backward() before it: the 4th and 8th "
        "calls are boundaries.",
    ),
}


def _run_script(script: Script) -> tuple[int, int, int]:
    """On a rank: the script on real DeepSpeed; its counters at the end."""
    import torch.distributed as dist

    from gas_lab.measure.parity import deepspeed_initialize

    model = tiny_model(0)
    engine = deepspeed_initialize()(
        model=model, model_parameters=model.parameters(), config=sgd_config(script.gas)
    )[0]
    micro = 0
    for op in script.ops:
        if op == "backward":
            x, y = micro_batch(0, 0, micro, dist.get_rank(), MICRO)
            micro += 1
            engine.backward(mse(engine(x), y))
        elif op == "step":
            engine.step()
        else:
            value = {"True": True, "False": False, "None": None}[op.split("=")[1]]
            engine.set_gradient_accumulation_boundary(value)
    return engine.micro_steps, engine.global_steps, engine.global_samples


def measured_counters(letter: str, cluster) -> tuple[int, int, int]:
    """What DeepSpeed's counters say after script ``letter`` (measured once per session)."""
    # The first DeepSpeed engine on fresh ranks imports DeepSpeed there: allow for it.
    return measured_once(
        ("lesson03 script", letter, cluster.world_size),
        lambda: tuple(cluster.run(_run_script, SCRIPTS[letter], timeout=180)[0]),
    )


COUNTERS = ("micro_steps", "global_steps", "global_samples")


def _judge_counters(script: Script, world: int, got, measured: tuple) -> str | Miss | None:
    micro, steps, samples = measured
    if not (isinstance(got, tuple | list) and len(got) == 3):
        return f"answer a tuple (micro_steps, global_steps, global_samples), got {got!r}."
    got = tuple(int(v) for v in got)
    if got == (micro, steps, samples):
        return None
    # What differs, never DeepSpeed's numbers: they are the answer.
    wrong = [
        f"{name} ({g})"
        for name, g, m in zip(COUNTERS, got, (micro, steps, samples), strict=True)
        if g != m
    ]
    right = [
        name for name, g, m in zip(COUNTERS, got, (micro, steps, samples), strict=True) if g == m
    ]
    differs = (
        f"you said {got}: your {' and '.join(wrong)} "
        f"{'is' if len(wrong) == 1 else 'are'} not what DeepSpeed counted"
        + (f"; {' and '.join(right)} {'is' if len(right) == 1 else 'are'} right." if right else ".")
    )
    backwards = script.ops.count("backward")
    train_batch = MICRO * script.gas * world
    if got[0] != micro and got[0] == backwards:
        return Miss(differs, "micro_steps counts step() calls, not backward() calls.")
    if got[:2] == (micro, steps) and got[2] == steps * MICRO * script.gas:
        return Miss(
            differs,
            f"global_samples grows by train_batch_size = micro x GAS x world = {train_batch} "
            "per update; the world size is missing.",
        )
    if got[:2] == (micro, steps):
        return Miss(
            differs,
            f"managed, every update adds train_batch_size = {train_batch} samples, however "
            "many micro-batches it really used.",
        )
    return Miss(differs, script.why)


def check_counter_predictions(fn: Callable[[], dict], cluster) -> Verdict:
    """Exercise 1: ``fn()`` returns ``{"A": (micro_steps, global_steps, global_samples), ...}``
    for every script of :data:`SCRIPTS`, predicted for DeepSpeed on the notebook's ranks."""
    return check_predictions(
        "predict the counters",
        fn,
        SCRIPTS,
        lambda letter: measured_counters(letter, cluster),
        lambda letter, got, measured: _judge_counters(
            SCRIPTS[letter], cluster.world_size, got, measured
        ),
        case="script",
        example="{'A': (10, 2, 32), ...}",
        hint="micro_steps counts step() calls; a call is a boundary when the override says so, "
        "else when (micro_steps + 1) % GAS == 0 before it counts; each update adds "
        "micro x GAS x world to global_samples.",
        where="the counters table (*The symmetric loop on 2 ranks, gas_lab and DeepSpeed*) and "
        "*The manual override*",
        module=__name__,
    )


# ---------------------------------------------------------------- exercise 2: epochs with a remainder
GAS = 3


def _windows(epochs: list[int], gas: int) -> list[list[int]]:
    """Each epoch's windows: as many full ones as fit, then the remainder."""
    return [[gas] * (n // gas) + ([n % gas] if n % gas else []) for n in epochs]


def _epoch_data(windows: list[list[int]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each epoch's micro-batches, drawn so that window w holds reference_params' step w."""
    data, w = [], 0
    for epoch in windows:
        data.append(
            [micro_batch(0, w + i, m, 0, MICRO) for i, n in enumerate(epoch) for m in range(n)]
        )
        w += len(epoch)
    return data


def _recorded(engine) -> list[int]:
    """Wrap the engine's backward() and step(): return the list that collects, for each
    update, how many micro-batches had gone through backward() when it happened."""
    updates, backwards = [], [0]
    backward, step = engine.backward, engine.step

    def counted_backward(*args, **kwargs):
        backwards[0] += 1
        return backward(*args, **kwargs)

    def counted_step(*args, **kwargs):
        before = engine.global_steps
        out = step(*args, **kwargs)
        updates.extend([backwards[0]] * (engine.global_steps - before))
        return out

    engine.backward, engine.step = counted_backward, counted_step
    return updates


def _run_epochs(fn: Callable, epochs: list[int]) -> dict:
    windows = _windows(epochs, GAS)
    model = tiny_model(0)
    engine = initialize(model=model, model_parameters=model.parameters(), config=sgd_config(GAS))[0]
    updates = _recorded(engine)
    fn(engine, _epoch_data(windows), mse)
    return {"windows": windows, "updates": updates, "params": flat_params(engine.module)}


def _judge_epochs(r: dict) -> str | Miss | None:
    windows, got = r["windows"], r["updates"]
    flat = [n for epoch in windows for n in epoch]
    want = [sum(flat[: i + 1]) for i in range(len(flat))]
    total = want[-1]
    if got != want:
        said = (
            f"updates after micro-batch {got} (counted over all epochs, {total} micro-batches); "
            f"expected after {want}, windows {windows}."
        )
        runs = [a for a, b, c in zip(got, got[1:], got[2:], strict=False) if c - b == b - a == 1]
        if runs:  # three micro-batches in a row each updated: windows of 1
            return Miss(
                f"{said} From micro-batch {runs[0]} on, every call updates.",
                "set_gradient_accumulation_boundary(True) is sticky: hand the boundary back "
                "with None, or set it before every micro-batch.",
            )
        if all(u % GAS == 0 for u in got):
            return Miss(
                f"{said} Every update came after a multiple of GAS = {GAS} micro-batches.",
                "only the counter decided: an epoch's remainder waited for the next epoch's "
                "micro-batches to fill its window. Decide the remainder's boundary yourself.",
            )
        first_epoch = len(windows[0])
        if got[:first_epoch] == want[:first_epoch]:
            return Miss(
                f"{said} The first epoch is right; the next ones are shifted.",
                "the remainder's step() calls moved micro_steps, so the counter's windows no "
                "longer start where an epoch starts: decide every window's boundary yourself.",
            )
        return said
    ref = reference_params(sgd_config(GAS), len(flat), flat, world_size=1)
    err = (r["params"] - ref).abs().max().item()
    if err <= TOL:
        return None
    short = [n for n in flat if n != GAS]
    return Miss(
        f"the updates happen at the right micro-batches, but the parameters are {err:.2g} from "
        f"the reference (the remainder windows have {short} micro-batches).",
        f"each window's micro-batches must weigh 1/N for a window of N; engine.backward() "
        f"divides by GAS = {GAS} unless scale_wrt_gas=False.",
    )


def check_epochs(fn: Callable) -> Verdict:
    """Exercise 2: ``fn(engine, epochs, loss_fn)`` trains a managed engine (GAS 3) on a list of
    epochs, each a list of ``(x, y)`` micro-batches: one update per GAS micro-batches and one
    for each epoch's remainder, every micro-batch of a window weighing the same."""
    cases = {
        "one epoch of 6 micro-batches (no remainder)": [6],
        "epochs of 7 and 5 micro-batches": [7, 5],
        "three epochs of 4 micro-batches": [4, 4, 4],
    }
    return check_cases(
        "epochs that do not divide by GAS",
        [(name, lambda e=e: _run_epochs(fn, e), _judge_epochs) for name, e in cases.items()],
        "the engine's counter only knows GAS-sized windows, and every step() call moves it. "
        "Decide every window's boundary yourself: set_gradient_accumulation_boundary(i == N - 1) "
        "before each backward, loss / N with scale_wrt_gas=False, one step() per window.",
        where="*The manual override: `set_gradient_accumulation_boundary()`*",
    )
