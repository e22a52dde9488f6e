"""The gradient the optimizer receives under each precision (appendix A2): at the boundary,
against a float64 reference, per micro-batch, and in DeepSpeed's accumulation buffer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gas_lab.measure.replay import DIMS, RecordingSGD, quiet_initializer
from gas_lab.toys import micro_batch, tiny_model


def boundary_gradient(lib: str, config: dict, n: int) -> dict:
    """The whole gradient the optimizer receives at the first update of a loop of ``n``
    micro-batches (gathered over ranks at ZeRO-1), the optimizer wrapper, and the model's
    gradient dtype after the first backward. Refusals come back as ``{"refused": ...}``."""
    managed = config.get("managed_gradient_accumulation", True)
    model = tiny_model(0, **DIMS)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    try:
        engine, wrapped, *_ = quiet_initializer(lib)(
            model=model, optimizer=optimizer, config=config
        )
    except Exception as err:  # the point: which libraries refuse, and with what
        # gas_lab's refusals name the exception type DeepSpeed raises for the same rule.
        raises = getattr(getattr(err, "rule", None), "deepspeed_raises", type(err).__name__)
        return {
            "refused": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}",
            "raises_as": raises,
        }
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
    engine, wrapped, *_ = quiet_initializer("deepspeed")(
        model=model, optimizer=optimizer, config=config
    )
    x, y = micro_batch(0, 0, 0, dist.get_rank(), 2, DIMS["d_in"], DIMS["d_out"])
    dtype = next(engine.module.parameters()).dtype
    engine.backward(torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
    # BF16_Optimizer: fp32 flat buffers; ZeRO-2 with a separate dtype: a flat partition per
    # param group (this rank's share only); otherwise the parameters' own .grad.
    held = list(getattr(wrapped, "fp32_groups_gradients_flat", []))
    held += [
        g.flat_partition
        for g in getattr(wrapped, "averaged_gradients", {}).values()
        if getattr(g, "flat_partition", None) is not None
    ]
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
