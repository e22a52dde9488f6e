"""The two sides of a check: the loop on the ranks, and one process replaying weights.

* :func:`trial` runs on every rank: it builds the model and the engine (DeepSpeed's or gas_lab's)
  for one ZeRO stage, calls the learner's ``fn(engine, micro_batches)`` once per step of a case,
  and returns the parameters, how many optimizer steps each call took, and whether the loop let
  ``engine.backward`` divide by ``gradient_accumulation_steps``.
* :func:`replay` runs in one process, without an engine: every micro-batch of every rank, each
  target's cross-entropy weighed as given (the step's objective is ``sum(weight *
  cross_entropy)``), then the config's clipping and optimizer. With the declared objective's
  weights it is the reference a right loop reaches; with a known mistake's, what that mistake
  would have done.
"""

from __future__ import annotations

import copy
import math

import torch

from gas_lab.check import models
from gas_lab.check.cases import BY_NAME
from gas_lab.check.objectives import Step, Weights
from gas_lab.deepspeed_compat.config import load_config
from gas_lab.toys import flat_params, one_thread

RTOL = 1e-5  # some real mistakes move a step by only 1-3 %; rounding moves it by about 1e-7
SEED = 0


def default_config(stage: int) -> dict:
    """The checker's config: SGD (every weight error shows, none is rescaled away), one
    micro-batch per engine step as DeepSpeed counts it, no clipping, the stage under test."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def config_for(stage: int, user: dict | None) -> dict:
    """The user's config with only the ZeRO stage and unmanaged accumulation set, or the
    checker's own."""
    if user is None:
        return default_config(stage)
    cfg = copy.deepcopy(user)
    cfg["managed_gradient_accumulation"] = False
    cfg.setdefault("zero_optimization", {})["stage"] = stage
    cfg.setdefault("train_micro_batch_size_per_gpu", 2)
    cfg.pop("train_batch_size", None)  # it names the world size the user's job had
    return cfg


def trial(fn, case: str, stage: int, library: str, config: dict | None, model: str = "toy") -> dict:
    """On every rank: the learner's loop, one call per step of ``case``; the parameters after
    the last step, the optimizer steps each call took, and the ``scale_wrt_gas`` of each of its
    ``engine.backward`` calls."""
    import torch.distributed as dist

    from gas_lab.measure.parity import initializer, quiet_deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    net = models.build(model, SEED)
    engine, *_ = initializer(library)(
        model=net, model_parameters=net.parameters(), config=config_for(stage, config)
    )
    scaled = []
    backward = engine.backward

    def recorded(loss, *args, **kwargs):
        scaled.append(bool(kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)))
        return backward(loss, *args, **kwargs)

    engine.backward = recorded  # what the loop passes is seen; what the engine does is its own
    took = []
    data = BY_NAME[case].data(SEED, world, models.CONVENTION[model])
    with quiet_deepspeed():
        for step in data:
            before = engine.global_steps
            fn(engine, [dict(mb) for mb in step.ranks[rank]])
            took.append(engine.global_steps - before)
    if stage == 3:  # ZeRO-3 partitions the weights themselves: gather them to compare
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = flat_params(engine.module)
    else:
        params = flat_params(engine.module)
    return {"params": params, "took": took, "scaled": scaled}


_MODELS: dict = {}  # model -> the seeded model, built once per process


def _fresh(model: str):
    if model not in _MODELS:
        _MODELS[model] = models.build(model, SEED)
    return copy.deepcopy(_MODELS[model])


def initial_params(model: str = "toy") -> torch.Tensor:
    return flat_params(_fresh(model))


def replay(
    steps: list[Step], weights: list[Weights], config: dict | None, model: str = "toy"
) -> torch.Tensor:
    """One process, no engine: the parameters after ``steps`` when each step's gradient is that
    of ``sum(weights * cross_entropy)`` over every rank's micro-batches (``weights[s]`` for step
    s), then the config's clipping and optimizer."""
    with one_thread():
        return _replay(steps, weights, config, model)


def _replay(steps, weights, config, model) -> torch.Tensor:
    cfg = load_config(config_for(0, config), world_size=steps[0].world_size if steps else 1)
    net = _fresh(model)
    optimizer = cfg.optimizer.torch_optimizer(net.parameters())
    for step, w in zip(steps, weights, strict=True):
        total = sum(
            (models.target_losses(model, net, mb) * w[r][m]).sum()
            for r, mbs in enumerate(step.ranks)
            for m, mb in enumerate(mbs)
        )
        if isinstance(total, int):  # no micro-batch anywhere: the engine steps on zeros
            for p in net.parameters():
                p.grad = torch.zeros_like(p)
        else:
            total.backward()
        # torch's clip scales by max_norm / (norm + 1e-6), as DeepSpeed does
        clip = cfg.gradient_clipping
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip if clip > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return flat_params(net)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, each parameter measured against its own size (or against the
    parameters' mean size, where it is smaller: a weight near 0 has no size of its own)."""
    if not torch.isfinite(got).all():
        return math.inf
    scale = torch.maximum(want.abs(), want.abs().mean())
    return ((got - want).abs() / scale).max().item()


def agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    return relative_error(got, want) <= RTOL
