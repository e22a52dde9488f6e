"""A checkpoint saved at a boundary or mid-window and resumed in a fresh engine, on either
library (lesson 08): what is restored, and what a resumed run ends with."""

from __future__ import annotations

import os

from gas_lab.measure.replay import build, counters, events, play
from gas_lab.toys import flat_params


def resume(
    lib: str, config: dict, micro_batches: list[int], save_after: int, restart_at: int, folder: str
) -> dict:
    """Save after event ``save_after`` (count of events run), load into a fresh engine built
    from another seed, replay the events from ``restart_at``; compare with an uninterrupted
    run. Call on every rank with the same ``folder``."""
    evs = events(config.get("managed_gradient_accumulation", True), micro_batches)
    reference, *_ = build(lib, config)
    play(reference, evs)
    saver, *_ = build(lib, config)
    play(saver, evs[:save_after])
    saved_at = counters(saver)
    saver.save_checkpoint(folder, client_state={"events_run": save_after})
    fresh, *_ = build(lib, config, seed=1)  # other weights: the load must overwrite them
    path, client = fresh.load_checkpoint(folder)
    after_load = counters(fresh)
    play(fresh, evs[restart_at:])
    final = flat_params(fresh.module)
    return {
        "saved_at": saved_at,
        "after_load": after_load,
        "final": counters(fresh),
        "reference": counters(reference),
        "client_state": client,
        "loaded": path is not None,
        "params": final,
        "diff_vs_uninterrupted": (final - flat_params(reference.module)).abs().max().item(),
    }


def save_points(managed: bool, micro_batches: list[int], window: int, after: int) -> dict:
    """Event positions for saving in ``window``: ``boundary`` (right after the previous
    window's update), ``mid`` (after ``after`` backward() calls of the window, before its
    step()), and ``window_start``, the first event of the window (where a resume redoes it)."""
    evs = events(managed, micro_batches)
    start = evs.index(("backward", window, 0))
    mid = evs.index(("backward", window, after - 1)) + 1
    return {"boundary": start, "mid": mid, "window_start": start}


PLANS = ("boundary", "mid, continue", "mid, redo the window")


def resume_plans(
    lib: str, config: dict, micro_batches: list[int], window: int, after: int, root: str
) -> dict:
    """:func:`resume` for the three plans of lesson 08, saving in ``window``: ``boundary``
    (save right after the previous window's update, continue from there), ``mid, continue``
    (save after ``after`` backward() calls of the window, continue with the next one) and
    ``mid, redo the window`` (the same save, restart the window from its first micro-batch).
    Checkpoints go to ``root/<lib>-<managed>-<plan>``. Call on every rank."""
    managed = config.get("managed_gradient_accumulation", True)
    at = save_points(managed, micro_batches, window, after)
    plans = {"boundary": (at["boundary"], at["boundary"]), "mid, continue": (at["mid"], at["mid"]),
             "mid, redo the window": (at["mid"], at["window_start"])}  # fmt: skip
    return {
        plan: resume(
            lib, config, micro_batches, save, restart, os.path.join(root, f"{lib}-{managed}-{plan}")
        )
        for plan, (save, restart) in plans.items()
    }


def resume_rows(rows: dict) -> list[dict]:
    """Lesson 08's table of :func:`resume_plans` results, ``rows[managed]`` for each mode:
    one row per mode and plan, DeepSpeed's numbers (the lesson asserts gas_lab's equal)."""

    def counts(d):
        return f"{d['global_steps']}, {d['global_samples']}, {d['micro_steps']}"

    return [
        {
            "mode": "managed" if managed else "unmanaged",
            "plan": plan,
            "|Δ| vs uninterrupted": f"{r['diff_vs_uninterrupted']:.2e}",
            "after load (steps, samples, micro_steps)": counts(r["after_load"]),
            "final": counts(r["final"]),
            "uninterrupted": counts(r["reference"]),
        }
        for managed, by_lib in rows.items()
        for plan, r in by_lib["deepspeed"].items()
    ]
