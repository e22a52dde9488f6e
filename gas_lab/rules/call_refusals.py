"""The refusals DeepSpeed makes at an engine call (a method, or entering a with-block): calls
that take the boundary out of ``step()``'s hands, or that ``no_sync()`` and
``coalesce_grad_reduction()`` cannot honour at this stage or mode.

At each call, a rule's ``order`` is where DeepSpeed checks it: its own checks in source order,
then what fails deeper inside the method.
"""

from __future__ import annotations

from gas_lab.rules.rule import (
    MGA,
    UNMANAGED,
    Example,
    Rule,
    in_no_sync,
    is_unmanaged,
    zero_stage,
)

CALL_REFUSALS: list[Rule] = [
    Rule(
        "unmanaged_set_boundary", "set_gradient_accumulation_boundary", "call",
        (MGA, "set_gradient_accumulation_boundary()"),
        "unmanaged, set_gradient_accumulation_boundary(True or False)",
        "Unmanaged, every step() is the boundary; an override contradicts it both ways.",
        "False: step() neither reduces nor updates while micro_steps advances, so training "
        "silently stops. True: every backward() reduces and step() reduces again: N+1 "
        "reductions instead of 1 (at ZeRO-1 DeepSpeed's step() then fails: IndexError).",
        "AssertionError", "set_gradient_accumulation_boundary() is not supported with "
        "managed_gradient_accumulation=False",
        Example(config=UNMANAGED, ops=("set_boundary_true",)),
        is_unmanaged,
        order=10,
    ),
    Rule(
        "unmanaged_coalesce", "coalesce_grad_reduction", "context",
        (MGA, "coalesce_grad_reduction()"),
        "unmanaged, entering coalesce_grad_reduction() (any stage)",
        "coalesce_grad_reduction() is managed mode's way to defer the reduction to the end of a "
        "block of backward() calls; unmanaged, step() already defers it.",
        "the flush at the end of the block and step() would both reduce the same gradients.",
        "AssertionError", "coalesce_grad_reduction is not supported with "
        "managed_gradient_accumulation=False",
        Example(config=UNMANAGED, ops=("enter_coalesce", "exit_coalesce")),
        is_unmanaged,
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
        lambda s: zero_stage(s) == 0,
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
        in_no_sync,
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
        lambda s: zero_stage(s) >= 2,
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
        in_no_sync,
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
        in_no_sync,
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
        lambda s: zero_stage(s) == 0,
        order=10,
    ),
]  # fmt: skip
