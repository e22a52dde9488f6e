"""Where the mean divides by the world size, measured (lessons 05 and 08): before the
all-reduce, after it, or not at all, on either library, per stage and config
(:func:`division`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gas_lab.measure.replay import DIMS, RecordingSGD, quiet_initializer
from gas_lab.toys import micro_batch, tiny_model


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
        engine, *_ = quiet_initializer(lib)(model=model, optimizer=optimizer, config=config)
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
    carried = [
        (c, t)
        for c, t in zip(log.calls, log.tensors, strict=True)
        if c.kind in ("all_reduce", "reduce") and t is not None and t[0].numel() > 1
    ]
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
    return [
        {"config": key, **{f"stage {s}": says(divided[(key, s)][lib]) for s in stages}}
        for key in keys
    ]
