"""Run one fp16 loop, with forced overflows, on gas_lab's :class:`~gas_lab.deepspeed_compat.fp16.Fp16Loop`
or on DeepSpeed's fp16 engine, and record what each step did.

A *plan* says, for each optimizer step, which micro-batch (if any) gets its loss multiplied by
``inf``; ``micro_batches`` says how many micro-batches each step runs (unmanaged only: managed
runs ``gradient_accumulation_steps``). Both libraries see the same model (same seed), the same
data and the same LR scheduler (``LambdaLR``, ``1 / (1 + n)`` after n applied steps), so the
records can be compared field by field::

    ours = run_plan("gas_lab", config, plan)
    ref = run_plan("deepspeed", config, plan)        # needs an accelerator with fp16: a GPU
    assert ours.steps == ref.steps

DeepSpeed refuses fp16 on a CPU without fp16 support (``engine.py:2003-2004``), so the
DeepSpeed side runs where ``torch.cuda.is_available()``, or on the CPU inside
:func:`fp16_check_lifted`, which lifts that one check so that DeepSpeed's own fp16 engine runs
with torch's CPU fp16 arithmetic (a configuration DeepSpeed does not support; appendix A1 says
so wherever it uses it). Call it on every rank.

:func:`sgd_updates` isolates two things DeepSpeed 0.19.8 does with the scale, on one weight
whose gradient is 1: the update on a step where the scale grows, and stage 0's unscaled loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gas_lab.deepspeed_compat.fp16 import Fp16Loop
from gas_lab.toys import flat_params, micro_batch, tiny_model

FIELDS = ("scale", "applied", "skipped_steps", "global_steps", "global_samples", "micro_steps")


def fp16_config(stage: int = 0, managed: bool = True, gas: int = 2, **fp16) -> dict:
    """A small fp16 config both libraries accept: torch's AdamW (no JIT build), no clipping,
    and a short scale window so a few steps show the scale move."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "managed_gradient_accumulation": managed,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True},
        },
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, **fp16},
        "steps_per_print": 10**9,
    }


@contextmanager
def fp16_support(answer: bool):
    """DeepSpeed's CPU accelerator says whether fp16 is supported by asking oneDNN, so the answer
    depends on the CPU (yes with AVX512-FP16, no on most laptops). Inside this block it says
    ``answer``, the only change."""
    from deepspeed.accelerator import get_accelerator

    cls = type(get_accelerator())
    original = cls.is_fp16_supported
    cls.is_fp16_supported = lambda self: answer
    try:
        yield
    finally:
        cls.is_fp16_supported = original


def fp16_check_lifted():
    """DeepSpeed's CPU accelerator says no to fp16 when oneDNN has no fp16 kernels; inside this
    block it says yes, so DeepSpeed's fp16 engine code runs on any CPU."""
    return fp16_support(True)


def schedule(optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR scheduler both sides use: it only moves when a step is applied."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0 / (1 + n))


@dataclass
class PlanResult:
    steps: list[dict] = field(default_factory=list)  # per step: FIELDS + scheduler_steps
    params: torch.Tensor | None = None  # after training, fp32, on the CPU
    grad_after_first_backward: float | None = None  # |grad| sum of the first layer, step 0


def _loss_scale(engine) -> float:
    scale = engine.loss_scale if isinstance(engine, Fp16Loop) else engine.optimizer.loss_scale
    return float(scale)


def run_plan(
    library: str,
    config: dict,
    plan: Sequence[int | None],
    micro_batches: Sequence[int] | None = None,
    inf_rank: int = 0,
    seed: int = 0,
    device: str | None = None,
    stage0_as_deepspeed: bool = True,
) -> PlanResult:
    """Train ``len(plan)`` steps; ``plan[i]`` is the micro-batch of step i whose loss becomes
    inf on rank ``inf_rank`` (None: a clean step)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = tiny_model(seed)
    if library == "gas_lab":
        engine = Fp16Loop(model.to(device), config, schedule, stage0_as_deepspeed)
    elif library == "deepspeed":
        import deepspeed

        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config, lr_scheduler=schedule
        )
    else:
        raise ValueError(f"library {library!r}: choose 'gas_lab' or 'deepspeed'")
    managed = engine.managed_gradient_accumulation()
    gas = engine.gradient_accumulation_steps()
    size = engine.train_micro_batch_size_per_gpu()
    result = PlanResult()
    for step, bad in enumerate(plan):
        n = gas if managed or micro_batches is None else micro_batches[step]
        record = {"scale": _loss_scale(engine)}
        for micro in range(n):
            x, y = micro_batch(seed, step, micro, rank, size)
            out = engine(x.to(engine.device).half())
            loss = (out.float() - y.to(engine.device)).pow(2).mean()
            if bad == micro and rank == inf_rank:
                loss = loss * float("inf")
            engine.backward(loss)
            if step == 0 and micro == 0:
                first = next(engine.module.parameters()).grad
                result.grad_after_first_backward = (
                    None if first is None else float(first.float().abs().sum())
                )
            if managed:
                engine.step()
        if not managed:
            engine.step()
        record.update(
            applied=engine.was_step_applied(),
            skipped_steps=engine.skipped_steps,
            global_steps=engine.global_steps,
            global_samples=engine.global_samples,
            micro_steps=engine.micro_steps,
            scheduler_steps=engine.lr_scheduler.last_epoch,
        )
        result.steps.append(record)
    result.params = flat_params(engine.module).float().cpu()
    return result


def compare(
    config: dict, plan: Sequence[int | None], micro_batches: Sequence[int] | None = None, **kw
) -> dict:
    """The same plan on gas_lab's loop and on DeepSpeed's fp16 engine, on this rank.

    Returns both step records, whether they are equal, and the largest parameter difference.
    """
    ours = run_plan("gas_lab", config, plan, micro_batches, **kw)
    ref = run_plan("deepspeed", config, plan, micro_batches, **kw)
    return {
        "gas_lab": ours.steps,
        "deepspeed": ref.steps,
        "steps_equal": ours.steps == ref.steps,
        "max_abs_diff": (ours.params - ref.params).abs().max().item(),
        "grad_after_first_backward": {
            "gas_lab": ours.grad_after_first_backward,
            "deepspeed": ref.grad_after_first_backward,
        },
    }


def sgd_updates(
    library: str,
    stage: int,
    steps: int = 3,
    loss_factor: float = 1.0,
    scale_power: int = 4,
    stage0_as_deepspeed: bool = True,
) -> dict:
    """Plain SGD (lr 1/8) on ``w * x`` with ``x = 1`` and the loss ``loss_factor * w * x``: the
    true gradient is ``loss_factor`` at every step. fp16, scale ``2**scale_power``, a window of 1
    (the scale doubles at every boundary DeepSpeed's rule allows), unmanaged. Returns, per step,
    the scale after it and the update ``w_before - w_after`` (exact in fp16 here: powers of two),
    and the fp16 gradient the first backward() left in ``.grad`` (scaled, or not). Call on every
    rank."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.5)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "optimizer": {"type": "SGD", "params": {"lr": 0.125}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "fp16": {"enabled": True, "initial_scale_power": scale_power, "loss_scale_window": 1},
        "steps_per_print": 10**9,
    }
    if library == "gas_lab":
        engine = Fp16Loop(model, config, stage0_as_deepspeed=stage0_as_deepspeed)
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    out = {"scale": [], "update": [], "first_grad": None}
    for step in range(steps):
        before = engine.module.weight.item()
        loss = engine(torch.ones(1, 1, dtype=torch.float16)).float().sum() * loss_factor
        engine.backward(loss)
        if step == 0:
            out["first_grad"] = engine.module.weight.grad.item()
        engine.step()
        out["update"].append(before - engine.module.weight.item())
        out["scale"].append(_loss_scale(engine))
    return out


# The plan the GPU checks use: infs in micro-batch 1 of step 2, micro-batch 0 of step 6 and
# micro-batch 1 of step 7; unmanaged steps run a different number of micro-batches each.
PLAN = [None, None, 1, None, None, None, 0, 1, None, None]
MICRO_BATCHES = [2, 3, 2, 1, 2, 1, 3, 2, 2, 2]


def compare_all(device: str = "cuda") -> dict:
    """Stages 0 and 1, managed and unmanaged: gas_lab's loop against DeepSpeed's fp16 engine,
    plus the first gradient of a textbook loop (loss scaled at every stage) for the stage-0 trap.
    """
    out = {}
    for stage in (0, 1):
        for managed in (True, False):
            config = fp16_config(stage, managed)
            mb = None if managed else MICRO_BATCHES
            result = compare(config, PLAN, mb, device=device)
            textbook = run_plan("gas_lab", config, [None], stage0_as_deepspeed=False, device=device)
            result["textbook_grad"] = textbook.grad_after_first_backward
            out[f"stage {stage}, {'managed' if managed else 'unmanaged'}"] = result
    return out


if __name__ == "__main__":  # one process per GPU under torchrun; rank 0 prints one JSON line
    import json

    from gas_lab.dp import init_from_env

    init_from_env()
    results = compare_all()
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
