"""The two sides of a check: the loop on the ranks, and one process replaying a normalization.

* :func:`trial` runs on every rank: it builds the engine (DeepSpeed's or gas_lab's) for one ZeRO
  stage, calls the learner's ``fn(engine, micro_batches)`` once per step of a case, and returns
  the parameters and how many optimizer steps each call took.
* :func:`replay` runs in one process, without an engine: every micro-batch of every rank, each
  token weighed as a :class:`~gas_lab.check.objectives.Normalization` says, averaged over the
  ranks as the engine averages, then the config's clipping and optimizer. With the declared
  objective it is the reference a right loop reaches; with a known mistake, what that mistake
  would have done.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from gas_lab.check.cases import BY_NAME, VOCAB, WORLD_SIZE
from gas_lab.check.objectives import Normalization, Step
from gas_lab.deepspeed_compat.config import load_config
from gas_lab.toys import TinySeqModel, flat_params

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


def model(seed: int = SEED) -> TinySeqModel:
    """A small language model: ``model(input_ids)`` returns logits [B, T, vocabulary]."""
    return TinySeqModel(seed, vocab=VOCAB)


def trial(fn, case: str, stage: int, library: str, config: dict | None) -> dict:
    """On every rank: the learner's loop, one call per step of ``case``; the parameters after
    the last step and the optimizer steps each call took."""
    import torch.distributed as dist

    from gas_lab.measure.parity import initializer, quiet_deepspeed

    rank = dist.get_rank()
    net = model()
    engine, *_ = initializer(library)(
        model=net, model_parameters=net.parameters(), config=config_for(stage, config)
    )
    took = []
    with quiet_deepspeed():
        for step in BY_NAME[case].data(SEED):
            before = engine.global_steps
            fn(engine, [dict(mb) for mb in step.ranks[rank]])
            took.append(engine.global_steps - before)
    if stage == 3:  # ZeRO-3 partitions the weights themselves: gather them to compare
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {"params": flat_params(engine.module), "took": took}
    return {"params": flat_params(engine.module), "took": took}


def token_losses(net, mb: dict) -> torch.Tensor:
    """Cross-entropy per position, [B, T]; 0 where the label is -100."""
    logits = net(mb["input_ids"])
    return F.cross_entropy(
        logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100, reduction="none"
    ).view(mb["labels"].shape)


def replay(steps: list[Step], normalization: Normalization, config: dict) -> torch.Tensor:
    """One process, no engine: the parameters after ``steps`` when every rank's micro-batch loss
    is weighed by ``normalization`` and the ranks' gradients are averaged."""
    cfg = load_config(config_for(0, config), world_size=WORLD_SIZE)
    net = model()
    optimizer = cfg.optimizer.torch_optimizer(net.parameters())
    for step in steps:
        total = sum(
            (token_losses(net, mb) * normalization.weights(step, r, m)).sum()
            for r, mbs in enumerate(step.ranks)
            for m, mb in enumerate(mbs)
        )
        if isinstance(total, int):  # no micro-batch anywhere: the engine steps on zeros
            for p in net.parameters():
                p.grad = torch.zeros_like(p)
        else:  # the engine averages the ranks' gradients, or sums them ("sum")
            (total / (1 if cfg.gradient_allreduce_op == "sum" else step.world_size)).backward()
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
