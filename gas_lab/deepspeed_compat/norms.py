"""The gradient norm and clipping, rounded as DeepSpeed 0.19.8 rounds them on each path.

The floor clips with :func:`gas_lab.dp.clip_by_norm`, ``min(1, max_norm / (norm + 1e-6))``, the
formula every DeepSpeed path uses. What differs between DeepSpeed's paths is where the numbers
are rounded and which collectives compute the norm; matching them bit for bit, and matching
DeepSpeed's collective counts, is this module's job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def replicated_grad_norm(grads: list[torch.Tensor], group=None) -> torch.Tensor:
    """The L2 norm of a gradient every rank holds whole (stage 0, after the reduction).

    The norm is the same on every rank already. DeepSpeed still averages it over ranks with a
    (4-byte) all-reduce, because with expert-parallel layers the ranks' norms differ; gas_lab
    does the same, so the collective counts match DeepSpeed's.
    """
    norm = torch.stack([g.detach().float().norm(2) for g in grads]).pow(2).sum().pow(0.5)
    if group is not None:
        norm = norm / float(dist.get_world_size(group))
        dist.all_reduce(norm, group=group)
    return norm


def clip_by_float_norm(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """DeepSpeed's bf16 stage-0 path (``FP16_UnfusedOptimizer``, lesson 08): the norm is a
    Python float and the factor is computed in float64 as ``1 / ((norm + 1e-6) / max_norm)``."""
    scale = (norm + 1e-6) / max_norm
    if scale > 1:
        for g in grads:
            g.mul_(1.0 / scale)


def clip_by_reciprocal(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """DeepSpeed's ZeRO-2 optimizer: ``1 / max(1, (norm + 1e-6) / max_norm)`` in float32
    (lesson 09 matches it bit for bit)."""
    coef = 1.0 / torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
