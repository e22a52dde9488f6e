"""The refusals of a ``step()`` on a rank with nothing to reduce: a rank with fewer micro-batches,
none included (appendix A3; the one statement of the rule is :mod:`gas_lab.measure.idle_rank`,
measured in ``data/deepspeed_0.19.8_idle_rank.json``).

DeepSpeed does not refuse these on purpose: it fails inside ``step()`` on that rank. gas_lab
refuses them at the same call, so a loop that would train here does not crash only on DeepSpeed.
At stages 1 and 2 the same failure comes in two modes, each rule written once by stage below.
"""

from __future__ import annotations

from gas_lab.rules.rule import MGA, UNMANAGED, Example, Rule, is_unmanaged, zero_stage

# A full window, then one whose last micro-step runs no backward(): the refined case.
_FULL_THEN_IDLE_WINDOW = ("backward", "step", "backward", "step", "backward", "step", "step")


def _idle_rank(
    stage: int, reason: str, prevents: str, raises: tuple[str, str], ops: tuple[str, ...]
) -> Rule:
    """Unmanaged, ZeRO ``stage``: a step() on a rank that ran no backward() since its last one."""
    return Rule(
        f"idle_rank_stage{stage}",
        "step",
        "call",
        (MGA, f"zero_optimization.stage={stage}", "step()"),
        f"unmanaged, ZeRO stage {stage}, step() on a rank that ran no backward() since its "
        "last step()",
        reason,
        prevents,
        *raises,
        Example(config={**UNMANAGED, "zero_optimization": {"stage": stage}}, ops=ops),
        lambda s: is_unmanaged(s) and zero_stage(s) == stage and s.idle,
        order=20,
    )


def _idle_window(stage: int, reason: str, prevents: str, which: str = "") -> Rule:
    """Managed, ZeRO ``stage``: the boundary step() on a rank that ran no backward() in the
    boundary micro-step (``which``: the condition's note on what counts as none)."""
    return Rule(
        f"idle_window_stage{stage}",
        "step",
        "call",
        (f"zero_optimization.stage={stage}", "step()"),
        f"managed, ZeRO stage {stage}, the boundary step() on a rank that ran no backward() in "
        f"the boundary micro-step{which}",
        reason,
        prevents,
        "TypeError",
        "'NoneType' object is not iterable",
        Example(config={"zero_optimization": {"stage": stage}}, ops=_FULL_THEN_IDLE_WINDOW),
        lambda s: not is_unmanaged(s) and zero_stage(s) == stage and s.no_boundary_backward,
        order=20,
    )


IDLE_RANK_REFUSALS: list[Rule] = [
    _idle_rank(
        1,
        reason="DeepSpeed's ZeRO-1 reduces, inside an unmanaged step(), the gradients this rank "
        "produced since the last one; with none it indexes an empty list and raises on this "
        "rank, while the other ranks wait in their gradient all-reduce and die when this one "
        "does. (Stage 0 reduces zeros for the missing gradients and trains right.) At stage 1 "
        "every rank calls backward() at least once: give an idle rank a dummy micro-batch "
        "whose loss is multiplied by 0 and counts no tokens (appendix A3 states the rule for "
        "every stage).",
        prevents="a loop that trains here (zeros for the idle rank) and crashes on DeepSpeed the "
        "first time a rank gets no data.",
        raises=("IndexError", "list index out of range"),
        ops=("step",),
    ),
    _idle_window(
        1,
        which=" (none, or one inside no_sync())",
        reason="DeepSpeed's ZeRO-1 averages the window's gradients in the backward() of the "
        "boundary micro-step, and step() computes the gradient norm from that average. A rank "
        "that ran no backward() there has none, even with backward() calls earlier in the "
        "window, and raises in step() (KeyError instead, in the very first window). Managed, "
        "every rank calls backward() gradient_accumulation_steps times, once per micro-step: "
        "give a rank with fewer micro-batches zero-weight ones, whose loss is multiplied by 0 "
        "(appendix A3 states the rule).",
        prevents="with every rank idle, an update from zero gradients (Adam's moments still move "
        "the weights); with one rank short, mismatched collectives.",
    ),
    _idle_rank(
        2,
        reason="DeepSpeed's ZeRO-2 finalizes, inside an unmanaged step(), the gradient partition "
        "this rank's backward() calls reduced into; with none the partition was never made and "
        "it raises on this rank, while the other ranks wait in a collective and die when this "
        "one does. At stage 2 every backward() reduces, so every rank calls it as often as the "
        "busiest rank: a rank with fewer micro-batches, none included, makes up the difference "
        "with zero-weight ones, whose loss is multiplied by 0 (appendix A3 states the rule).",
        prevents="a loop that trains here and crashes on DeepSpeed the first time a rank gets no "
        "data.",
        raises=("TypeError", "'NoneType' object is not subscriptable"),
        # A step with data first: in the very first window DeepSpeed raises KeyError instead.
        ops=("backward", "step", "step"),
    ),
    _idle_window(
        2,
        reason="As at stage 1 (the same DeepSpeed code): the backward() of the boundary "
        "micro-step finishes the gradient partition step() computes the norm from, and a rank "
        "that ran none there has none, even with backward() calls earlier in the window. "
        "Managed, every rank calls backward() gradient_accumulation_steps times, once per "
        "micro-step: give a rank with fewer micro-batches zero-weight ones, whose loss is "
        "multiplied by 0 (appendix A3 states the rule).",
        prevents="with every rank idle, an update from zero gradients; with one rank short, "
        "mismatched collectives.",
    ),
    Rule(
        "idle_window_stage0_clipping",
        "step",
        "call",
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
        "IndexError",
        "list index out of range",
        Example(config={"gradient_accumulation_steps": 1, "gradient_clipping": 1.0}, ops=("step",)),
        lambda s: (
            not is_unmanaged(s) and zero_stage(s) == 0 and s.config.gradient_clipping > 0 and s.idle
        ),
        order=20,
    ),
]
