"""The measurements behind lesson 08 and appendix A2 (and lesson 05's :func:`division`), run on a rank with either library
(``"gas_lab"`` or ``"deepspeed"``; :func:`both` runs one on each): the learning rate at every
``step()``, a checkpoint resumed at a boundary or mid-window, where the mean divides by the
world size (:func:`division`: before the all-reduce or after it), and the gradient the
optimizer receives under each precision (A2).

A training loop is written as a list of *events*, ``("backward", step, micro)`` and
``("step", step)``, so that a run can stop after any event, save, and continue in a fresh
engine from any other event. Managed, a ``step()`` follows every ``backward()``; unmanaged, one
``step()`` follows the last ``backward()`` of a window. The notebooks and ``tests/test_edges.py``
/ ``tests/test_precision.py`` call the same functions, so the numbers the notebooks print are
the ones the tests check.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from gas_lab.measure.parity import initializer
from gas_lab.toys import flat_params, micro_batch, tiny_model


def events(managed: bool, micro_batches: list[int]) -> list[tuple]:
    """The calls of a loop that runs ``micro_batches[s]`` micro-batches in step s."""
    out = []
    for step, n in enumerate(micro_batches):
        for micro in range(n):
            out.append(("backward", step, micro))
            if managed:
                out.append(("step", step))
        if not managed:
            out.append(("step", step))
    return out


def counters(engine) -> dict:
    return {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
    }


def play(engine, evs, seed: int = 0, lr_kwargs=None, loss_scale: float = 1.0) -> list[dict]:
    """Run the events on this rank; after every ``step()``: the lr, the scheduler's counter
    and the engine's counters. Inputs are cast to the model's dtype (bf16 engines)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    size = engine.train_micro_batch_size_per_gpu()
    dtype = next(engine.module.parameters()).dtype
    trace = []
    for kind, step, *micro in evs:
        if kind == "backward":
            x, y = micro_batch(seed, step, micro[0], rank, size)
            loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss * loss_scale)
        else:
            engine.step(lr_kwargs=lr_kwargs(step) if callable(lr_kwargs) else lr_kwargs)
            sched = engine.lr_scheduler
            trace.append({"lr": engine.get_lr()[0], "applied": engine.was_step_applied(),
                          "last_batch_iteration": getattr(sched, "last_batch_iteration", None),
                          **counters(engine)})  # fmt: skip
    return trace


def _quiet_initializer(lib: str):
    """``initializer(lib)``, with DeepSpeed's logging quieted *after* its import (which sets
    its logger's level): no progress, memory or 'scheduler not started' lines."""
    import logging

    init = initializer(lib)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return init


def build(lib: str, config: dict, seed: int = 0, **kw):
    """A fresh engine of ``lib`` on ``tiny_model(seed)`` (``model=`` to pass another)."""
    model = kw.pop("model", None) or tiny_model(seed)
    init = _quiet_initializer(lib)
    return init(model=model, model_parameters=model.parameters(), config=config, **kw)


LIBS = ("gas_lab", "deepspeed")


def both(measure, *args, **kwargs) -> dict:
    """``{lib: measure(lib, *args, **kwargs)}`` for gas_lab and DeepSpeed, in that order (the
    same order on every rank): one measurement, run on each engine."""
    return {lib: measure(lib, *args, **kwargs) for lib in LIBS}


def lr_trace(lib: str, config: dict, micro_batches: list[int], lr_kwargs=None) -> dict:
    """The lr and counters after every ``step()`` of a loop, and the lr before the first."""
    engine, *_ = build(lib, config)
    before = engine.get_lr()[0]
    managed = engine.managed_gradient_accumulation()
    trace = play(engine, events(managed, micro_batches), lr_kwargs=lr_kwargs)
    return {"lr_at_start": before, "trace": trace, "params": flat_params(engine.module)}


def resume(lib: str, config: dict, micro_batches: list[int], save_after: int, restart_at: int,
           folder: str) -> dict:  # fmt: skip
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
        "saved_at": saved_at, "after_load": after_load, "final": counters(fresh),
        "reference": counters(reference), "client_state": client, "loaded": path is not None,
        "params": final, "diff_vs_uninterrupted":
            (final - flat_params(reference.module)).abs().max().item(),
    }  # fmt: skip


def save_points(managed: bool, micro_batches: list[int], window: int, after: int) -> dict:
    """Event positions for saving in ``window``: ``boundary`` (right after the previous
    window's update), ``mid`` (after ``after`` backward() calls of the window, before its
    step()), and ``window_start``, the first event of the window (where a resume redoes it)."""
    evs = events(managed, micro_batches)
    start = evs.index(("backward", window, 0))
    mid = evs.index(("backward", window, after - 1)) + 1
    return {"boundary": start, "mid": mid, "window_start": start}


PLANS = ("boundary", "mid, continue", "mid, redo the window")


def resume_plans(lib: str, config: dict, micro_batches: list[int], window: int, after: int,
                 root: str) -> dict:  # fmt: skip
    """:func:`resume` for the three plans of lesson 08, saving in ``window``: ``boundary``
    (save right after the previous window's update, continue from there), ``mid, continue``
    (save after ``after`` backward() calls of the window, continue with the next one) and
    ``mid, redo the window`` (the same save, restart the window from its first micro-batch).
    Checkpoints go to ``root/<lib>-<managed>-<plan>``. Call on every rank."""
    managed = config.get("managed_gradient_accumulation", True)
    at = save_points(managed, micro_batches, window, after)
    plans = {"boundary": (at["boundary"], at["boundary"]), "mid, continue": (at["mid"], at["mid"]),
             "mid, redo the window": (at["mid"], at["window_start"])}  # fmt: skip
    return {plan: resume(lib, config, micro_batches, save, restart,
                         os.path.join(root, f"{lib}-{managed}-{plan}"))
            for plan, (save, restart) in plans.items()}  # fmt: skip


def resume_rows(rows: dict) -> list[dict]:
    """Lesson 08's table of :func:`resume_plans` results, ``rows[managed]`` for each mode:
    one row per mode and plan, DeepSpeed's numbers (the lesson asserts gas_lab's equal)."""

    def counts(d):
        return f"{d['global_steps']}, {d['global_samples']}, {d['micro_steps']}"

    return [{"mode": "managed" if managed else "unmanaged", "plan": plan,
             "|Δ| vs uninterrupted": f"{r['diff_vs_uninterrupted']:.2e}",
             "after load (steps, samples, micro_steps)": counts(r["after_load"]),
             "final": counts(r["final"]), "uninterrupted": counts(r["reference"])}
            for managed, by_lib in rows.items() for plan, r in by_lib["deepspeed"].items()]  # fmt: skip


class RecordingSGD(torch.optim.SGD):
    """SGD with lr 0 that keeps the gradient it is handed at each step (the parameters it
    sees: fp32 masters or a ZeRO shard, whatever the engine gives its optimizer)."""

    def step(self, closure=None):
        self.seen = torch.cat([p.grad.detach().double().reshape(-1)
                               for g in self.param_groups for p in g["params"]
                               if p.grad is not None])  # fmt: skip
        return super().step(closure)


DIMS = {"d_in": 16, "hidden": 64, "d_out": 8}  # a model with a few thousand weights


def boundary_gradient(lib: str, config: dict, n: int) -> dict:
    """The whole gradient the optimizer receives at the first update of a loop of ``n``
    micro-batches (gathered over ranks at ZeRO-1), the optimizer wrapper, and the model's
    gradient dtype after the first backward. Refusals come back as ``{"refused": ...}``."""
    managed = config.get("managed_gradient_accumulation", True)
    model = tiny_model(0, **DIMS)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    try:
        engine, wrapped, *_ = _quiet_initializer(lib)(model=model, optimizer=optimizer,
                                                      config=config)  # fmt: skip
    except Exception as err:  # the point: which libraries refuse, and with what
        # gas_lab's refusals name the exception type DeepSpeed raises for the same rule.
        raises = getattr(getattr(err, "rule", None), "deepspeed_raises", type(err).__name__)
        return {"refused": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}",
                "raises_as": raises}  # fmt: skip
    rank = dist.get_rank()
    dtype = next(engine.module.parameters()).dtype
    for micro in range(n):
        x, y = micro_batch(0, 0, micro, rank, 2, DIMS["d_in"], DIMS["d_out"])
        engine.backward(torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
        if managed:
            engine.step()
    if not managed:
        engine.step()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, optimizer.seen)
    numel = sum(p.numel() for p in model.parameters())
    seen = optimizer.seen if optimizer.seen.numel() >= numel else torch.cat(parts)
    wrapper = "none" if wrapped is optimizer else type(wrapped).__name__  # DeepSpeed's wrapper
    if lib == "gas_lab":  # the one gas_lab mirrors
        wrapper = engine.precision.wrapper or "none"
    return {"gradient": seen[:numel], "wrapper": wrapper}


def reference_gradient(n: int, dtype=torch.float32) -> torch.Tensor:
    """The gradient a correct loop hands the optimizer (mean over ranks of the sum over ``n``
    micro-batches of ``loss / n``), each micro-batch computed in ``dtype`` and summed in
    float64 with no rounding: the floor any accumulation can reach. Call on every rank."""
    model = tiny_model(0, **DIMS).to(dtype)
    total = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    for micro in range(n):
        model.zero_grad(set_to_none=True)
        x, y = micro_batch(0, 0, micro, dist.get_rank(), 2, DIMS["d_in"], DIMS["d_out"])
        (torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y) / n).backward()
        total += torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _ratio(x: torch.Tensor, ref: torch.Tensor, world_size: int) -> float | None:
    """1.0 if ``x`` holds exactly the elements of ``ref`` (in any order), ``1 / world_size`` if
    it holds them divided by it, else None. Order-free: buckets reorder the elements."""
    if x.numel() != ref.numel():
        return None
    x = x.double().sort().values
    for ratio in (1.0, 1.0 / world_size):
        if torch.equal(x, (ref.double() * ratio).sort().values):
            return ratio
    return None


def division(lib: str, config: dict, stage: int | None = None, dims: dict | None = None) -> dict:
    """Where ``lib`` divides by the world size W under ``config`` (its ZeRO stage and keys):
    one micro-batch, one ``step()``, clipping off, a recording SGD. Returns ``handed``: what
    each rank hands its gradient all-reduces, as a fraction of its local gradient (1: the sum
    comes first; 1/W: divided before); ``final``: the gradient the optimizer receives, as a
    fraction of the sum over ranks (1/W: a mean; 1: the sum); ``where``: "before", "after"
    or "none"; ``collectives``: the kinds that carried the gradient; ``calls``: each of those
    collectives as (torch.distributed function, bytes); ``received``: the gradient the
    optimizer received (every rank's part, in the flat vector's order), as Python floats: ``==``
    compares their bits.
    Refusals come back as ``{"refused": ...}``. Exact at W = 2 (halving is exact in fp32).
    ``stage``: set ``zero_optimization.stage`` (the config's other ZeRO keys kept); ``dims``:
    the toy model's sizes (default :data:`DIMS`; ``{}``: lesson 05's 58-weight model). Lessons
    05 and 08 and tests/test_edges.py call it. Call on every rank."""
    from gas_lab.measure.comm import count_collectives

    dims = DIMS if dims is None else dims
    if stage is not None:
        config = {**config, "zero_optimization": {**config.get("zero_optimization", {}),
                                                  "stage": stage}}  # fmt: skip
    config = {"steps_per_print": 10**9, **config, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "train_micro_batch_size_per_gpu": 2}  # fmt: skip
    config.pop("optimizer", None)  # the recording SGD is the client optimizer
    model = tiny_model(0, **dims)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    try:
        engine, *_ = _quiet_initializer(lib)(model=model, optimizer=optimizer, config=config)
    except Exception as err:  # which library refuses, and with what
        return {"refused": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = micro_batch(0, 0, 0, rank, 2, d_in=dims.get("d_in", 4), d_out=dims.get("d_out", 2))
    reference = tiny_model(0, **dims)  # the same weights, the same micro-batch, plain torch
    torch.nn.functional.mse_loss(reference(x), y).backward()
    local = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    summed = local.clone()
    dist.all_reduce(summed)  # the sum over ranks (2 addends: exact in any order)
    with count_collectives(keep_tensors=True) as log:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    # The gradient's collectives: the all-reduces and reduces of more than one element (the
    # 4-byte gradient norm is one).
    carried = [(c, t) for c, t in zip(log.calls, log.tensors, strict=True)
               if c.kind in ("all_reduce", "reduce") and t is not None and t[0].numel() > 1]  # fmt: skip
    handed = torch.cat([t[0].reshape(-1) for _, t in carried]) if carried else local.new_zeros(0)
    parts = [None] * world
    dist.all_gather_object(parts, optimizer.seen)
    seen = optimizer.seen if optimizer.seen.numel() >= local.numel() else torch.cat(parts)
    final = seen[: local.numel()]
    out = {"handed": _ratio(handed, local, world), "final": _ratio(final, summed, world),
           "collectives": sorted({c.kind for c, _ in carried}),
           "calls": [(c.op, c.bytes) for c, _ in carried],
           "received": tuple(final.tolist())}  # fmt: skip
    if out["handed"] == 1.0 / world:
        out["where"] = "before"
    elif out["handed"] == 1.0:
        out["where"] = {1.0 / world: "after", 1.0: "none"}.get(out["final"])
    else:
        out["where"] = None
    engine.destroy()
    return out


def micro_gradients(n: int, dtype=torch.bfloat16, rank: int | None = None) -> list[torch.Tensor]:
    """Rank ``rank``'s gradient of each of the ``n`` micro-batches of
    :func:`boundary_gradient`'s loop, one flat tensor each, as a ``dtype`` model's backward
    writes it (``loss / n``: what ``engine.backward`` hands autograd). Nothing added up yet:
    the inputs of appendix A2's exercise. ``rank`` None: this rank's (0 without ranks)."""
    model = tiny_model(0, **DIMS).to(dtype)
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    out = []
    for micro in range(n):
        model.zero_grad(set_to_none=True)
        x, y = micro_batch(0, 0, micro, rank, 2, DIMS["d_in"], DIMS["d_out"])
        (torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y) / n).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return out


def accumulation_buffer(config: dict) -> dict:
    """DeepSpeed only: where its optimizer wrapper adds micro-batch gradients up, read after
    the first ``backward()`` of a window: the wrapper, ZeRO's ``use_separate_grad_accum``
    (None for a wrapper without it), ``gradient_accumulation_dtype`` as ZeRO declares it, and
    the dtypes and size of the tensors found holding the running sum (``buffer`` None: none
    in the places looked at). Call on every rank."""
    model = tiny_model(0, **DIMS)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    engine, wrapped, *_ = _quiet_initializer("deepspeed")(model=model, optimizer=optimizer,
                                                          config=config)  # fmt: skip
    x, y = micro_batch(0, 0, 0, dist.get_rank(), 2, DIMS["d_in"], DIMS["d_out"])
    dtype = next(engine.module.parameters()).dtype
    engine.backward(torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
    # BF16_Optimizer: fp32 flat buffers; ZeRO-2 with a separate dtype: a flat partition per
    # param group (this rank's share only); otherwise the parameters' own .grad.
    held = list(getattr(wrapped, "fp32_groups_gradients_flat", []))
    held += [g.flat_partition for g in getattr(wrapped, "averaged_gradients", {}).values()
             if getattr(g, "flat_partition", None) is not None]  # fmt: skip
    if getattr(wrapped, "grads_in_partition", None) is not None:  # ZeRO-2, the model's dtype
        held.append(wrapped.grads_in_partition)
    held = held or [p.grad for p in engine.module.parameters() if p.grad is not None]
    declared = getattr(wrapped, "gradient_accumulation_dtype", None)
    out = {"wrapper": type(wrapped).__name__,
           "use_separate_grad_accum": getattr(wrapped, "use_separate_grad_accum", None),
           "gradient_accumulation_dtype": str(declared).removeprefix("torch.") if declared else None,
           "buffer": sorted({str(t.dtype).removeprefix("torch.") for t in held}) or None,
           "buffer_numel": sum(t.numel() for t in held)}  # fmt: skip
    engine.destroy()
    return out


SAYS = {"before": "divided, then summed", "after": "summed, then divided", "none": "summed only"}


def division_rows(divided: dict, lib: str = "deepspeed") -> list[dict]:
    """Lesson 08's table of :func:`division` results, ``divided[(key, stage)][lib]``: one row
    per key, one column per stage, in words."""

    def says(r):
        if "refused" in r:
            return "refused: " + r["refused"].split(":")[0]
        return f"{SAYS[r['where']]} (hands over {r['handed']:g} x its gradient)"

    stages = sorted({stage for _, stage in divided})
    keys = list(dict.fromkeys(key for key, _ in divided))
    return [{"config": key, **{f"stage {s}": says(divided[(key, s)][lib]) for s in stages}}
            for key in keys]  # fmt: skip
