"""Accepted, but silently wrong: combinations DeepSpeed runs that still train the wrong model.

``gas_lab/rules/refusals.py`` lists what DeepSpeed refuses. This module lists what it *accepts* although
the result is wrong, each with its symptom and the one-line rule that avoids it. The lesson that
teaches each one measures it on DeepSpeed: lesson 04 (N != GAS, different N at ZeRO 0/1,
loss.backward() at ZeRO-1), lesson 09 (different N at ZeRO-2/3), lesson 06 (the flag).
A :class:`Trap` looks at the raw config dict (as DeepSpeed reads it, typos and all) and at a
few facts about the training loop, a :class:`Loop`::

    traps({"managed_gradient_accumulation": False, "gradient_accumulation_steps": 4},
          Loop(micro_batches=(3, 3)))      # [Trap("n_not_gas_default_scaling", ...)]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Loop:
    """The facts about a training loop that the traps below look at."""

    micro_batches: tuple[int, ...] = ()  # backward() calls per step on each rank; () = GAS
    scale_wrt_gas: bool = True  # engine.backward(loss, scale_wrt_gas=...)
    backward: str = "engine"  # "engine": engine.backward(loss); "tensor": loss.backward()
    loss_divisor: str = "none"  # "none", "local" (own N) or "global" (all ranks' N / W)


@dataclass(frozen=True)
class Trap:
    """A combination DeepSpeed accepts that still trains wrong, and the rule that avoids it."""

    name: str
    condition: str
    symptom: str  # what goes wrong, measured on DeepSpeed by the lesson that teaches it
    fix: str  # the one-line rule that avoids it
    applies: Callable[[dict, Loop], bool] = field(repr=False, compare=False, default=None)


def _raw_unmanaged(config: dict) -> bool:
    return config.get("managed_gradient_accumulation", True) is False


def _misspelt_managed(config: dict) -> bool:
    """A value DeepSpeed reads as true but is not True, or a near-miss of the key's name."""
    value = config.get("managed_gradient_accumulation", True)
    wrong_value = not isinstance(value, bool) and bool(value)
    return wrong_value or any(
        k != "managed_gradient_accumulation" and "managed" in k for k in config
    )


def _uneven(config: dict, loop: Loop) -> bool:
    return len(set(loop.micro_batches)) > 1


def _zero_stage(config: dict) -> int:
    return config.get("zero_optimization", {}).get("stage", 0)


TRAPS: list[Trap] = [
    Trap(
        "managed_flag_not_false", 'managed_gradient_accumulation misspelt, or not the bool false',
        "DeepSpeed ignores unknown keys and takes any truthy value (\"no\") as true: the run is "
        "silently *managed*, and step() updates only every gradient_accumulation_steps calls.",
        "right after initialize: assert engine.managed_gradient_accumulation() is False",
        lambda c, loop: _misspelt_managed(c),
    ),
    Trap(
        "n_not_gas_default_scaling", "unmanaged, N != gradient_accumulation_steps, default scaling",
        "backward() still divides every loss by gradient_accumulation_steps: the gradient is "
        "N/GAS times the mean.",
        "unmanaged: backward(loss, scale_wrt_gas=False) and normalize the loss yourself",
        lambda c, loop: _raw_unmanaged(c) and loop.scale_wrt_gas and any(
            n != c.get("gradient_accumulation_steps", 1) for n in loop.micro_batches),
    ),
    Trap(
        "uneven_n_zero01", "unmanaged, ZeRO 0/1, ranks run different N, no global count",
        "it runs; but each rank's micro-batches weigh 1/(W*N_rank) (or 1/(W*GAS)) instead of "
        "1/N_total, and global_samples differs from rank to rank.",
        "all-reduce N (or the token count) before the first backward(); divide each loss by "
        "N_total / W (DeepSpeed's mean over the W ranks then makes it 1/N_total)",
        lambda c, loop: _raw_unmanaged(c) and _zero_stage(c) < 2 and _uneven(c, loop)
        and loop.loss_divisor != "global",
    ),
    Trap(
        "uneven_n_zero23", "unmanaged, ZeRO 2/3, ranks run different N",
        "ZeRO-2/3 reduce inside every backward(): a rank with more backward() calls waits in a "
        "collective the others never join: on gloo a rank dies (measured, lesson 09); under NCCL "
        "the job can hang instead.",
        "at ZeRO-2/3 every rank calls backward() the same number of times per step",
        lambda c, loop: _raw_unmanaged(c) and _zero_stage(c) >= 2 and _uneven(c, loop),
    ),
    Trap(
        "tensor_backward_zero1", "unmanaged, ZeRO >= 1, loss.backward() instead of engine's",
        "DeepSpeed's hook on the model output divides the gradient by gradient_accumulation_steps, "
        "as engine.backward(loss) with the default scaling does: a loss already divided by N "
        "gives updates GAS times too small (lesson 04); and global_samples counts only "
        "engine.backward() calls: it stays 0.",
        "always engine.backward(loss, scale_wrt_gas=False), never loss.backward()",
        lambda c, loop: _raw_unmanaged(c) and _zero_stage(c) >= 1 and loop.backward == "tensor",
    ),
]  # fmt: skip


def traps(config: dict, loop: Loop) -> list[Trap]:
    """The traps an accepted config and loop fall into (empty: nothing known to go wrong)."""
    return [t for t in TRAPS if t.applies(config, loop)]
