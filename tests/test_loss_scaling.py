"""gas_lab's fp16 loss scaler and the loop around it, against hand computations (CPU) and against
DeepSpeed 0.19.8: its own scaler classes (CPU), its fp16 engine on the CPU accelerator with the
accelerator's fp16 check lifted (2 CPU ranks), and its fp16 engine on a GPU (marked ``gpu``)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from gas_lab.deepspeed_compat.fp16 import Fp16Loop
from gas_lab.deepspeed_compat.loss_scaling import (
    DynamicLossScaler,
    LossScaleAtMinimum,
    for_deepspeed,
)
from gas_lab.errors import ConfigError
from gas_lab.measure.loss_scale import fp16_check_lifted, fp16_config, run_plan, sgd_updates

F, T = False, True
# One sequence of boundaries (True = the accumulated gradient overflowed) and, worked out by
# hand with init 16, window 3, hysteresis 2 (ZeRO-1) or none (stage 0), the scale after each.
OVERFLOWS = [F, F, F, F, T, F, T, T, F, F, F, F, T]
# ZeRO-1: clean steps 0-3 -> stable interval 3 at step 3: double to 32 (hysteresis refilled).
# Step 4 overflows: hysteresis 2 -> 1, scale kept. Step 5 clean (interval 0). Step 6 overflows
# with hysteresis 1: halve to 16; step 7 again: 8 (clean steps do not refill it). Steps 8-11
# clean: interval 3 at step 11: double to 16 and refill; step 12 overflows: hysteresis again.
ZERO1_SCALES = [16, 16, 16, 32, 32, 32, 16, 8, 8, 8, 8, 16, 16]
ZERO1_EVENTS = ["kept"] * 3 + ["doubled", "hysteresis", "kept", "halved", "halved"]
ZERO1_EVENTS += ["kept"] * 3 + ["doubled", "hysteresis"]
# Stage 0: every overflow halves at once.
STAGE0_SCALES = [16, 16, 16, 32, 16, 16, 8, 4, 4, 4, 4, 8, 4]


def drive(scaler, overflows):
    events, scales = [], []
    for overflow in overflows:
        events.append(scaler.update(overflow))
        scales.append(scaler.scale)
    return events, scales


def test_deepspeed_defaults():
    for stage, hysteresis in ((0, 1), (1, 2)):
        s = for_deepspeed({"enabled": True}, stage)
        assert (s.scale, s.scale_window, s.hysteresis, s.min_scale) == (
            2.0**16,
            1000,
            hysteresis,
            1,
        )
        assert s.raise_at_min_scale == (stage == 1)


def test_schedule_by_hand_zero1_and_stage0():
    fp16 = {"initial_scale_power": 4, "loss_scale_window": 3}
    events, scales = drive(for_deepspeed(fp16, 1), OVERFLOWS)
    assert scales == ZERO1_SCALES and events == ZERO1_EVENTS
    _, scales = drive(for_deepspeed(fp16, 0), OVERFLOWS)
    assert scales == STAGE0_SCALES


def test_consecutive_hysteresis_refills_on_every_clean_step():
    s = DynamicLossScaler(
        init_scale=16, scale_window=100, hysteresis=2, consecutive_hysteresis=True
    )
    # overflow, clean, overflow: the clean step refilled the hysteresis, so no halving at all
    assert drive(s, [T, F, T])[1] == [16, 16, 16]
    s = DynamicLossScaler(init_scale=16, scale_window=100, hysteresis=2)
    assert drive(s, [T, F, T])[1] == [16, 16, 8]


def test_floor_raises_at_zero1_and_holds_at_stage0():
    fp16 = {"initial_scale_power": 1, "min_loss_scale": 1}  # scale 2
    assert drive(for_deepspeed(fp16, 0), [T, T, T])[1] == [1, 1, 1]
    zero1 = for_deepspeed(fp16, 1)
    assert drive(zero1, [T, T])[1] == [2, 1]  # hysteresis, then halve to the floor
    with pytest.raises(LossScaleAtMinimum, match="min_scale=1"):
        zero1.update(True)
    assert isinstance(LossScaleAtMinimum("x"), Exception)  # DeepSpeed raises a plain Exception


def test_static_scale_never_moves():
    s = for_deepspeed({"loss_scale": 128}, 1)
    assert drive(s, OVERFLOWS)[1] == [128] * len(OVERFLOWS)


@pytest.mark.parametrize(
    "fp16, key",
    [
        ({"loss_scale_window": 0}, "fp16.loss_scale_window"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale"),
        ({"loss_scale": -1}, "fp16.loss_scale"),
        ({"hystersis": 2}, "fp16.hystersis"),
    ],
)
def test_bad_fp16_settings_name_the_key(fp16, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        for_deepspeed(fp16, 1)


def test_unscale_and_overflow_check():
    s = DynamicLossScaler(init_scale=2.0**10)
    scaled_loss = s.scale_loss(torch.tensor(0.5, dtype=torch.float16))
    assert scaled_loss.dtype == torch.float32 and scaled_loss.item() == 512.0  # fp32: no overflow
    g = torch.tensor([3072.0, -512.0], dtype=torch.float16)  # a gradient of the scaled loss
    s.unscale_([g, None])
    assert g.tolist() == [3.0, -0.5]  # dividing by a power of two is exact
    assert not s.found_overflow([g, None])
    assert s.found_overflow([g, torch.tensor([1.0, float("nan")])])
    assert s.found_overflow([torch.tensor([float("-inf")])])


def test_matches_deepspeed_scaler_classes(monkeypatch):
    """The same 300 random boundaries through DeepSpeed's own state machines (ZeRO-1's
    DynamicLossScaler and stage 0's FP16_UnfusedOptimizer._update_scale) and through ours."""
    from deepspeed.runtime.fp16 import loss_scaler as ds_scaler
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    monkeypatch.setattr(ds_scaler.dist, "get_rank", lambda: 0)  # it only logs on rank 0
    gen = torch.Generator().manual_seed(0)
    overflows = (torch.rand(300, generator=gen) < 0.15).tolist()
    args = dict(init_scale=2.0**8, scale_window=5, min_scale=0.5)
    for consecutive in (False, True):
        ds = ds_scaler.DynamicLossScaler(
            delayed_shift=3,
            consecutive_hysteresis=consecutive,
            raise_error_at_min_scale=False,
            **args,
        )
        ours = DynamicLossScaler(
            hysteresis=3, consecutive_hysteresis=consecutive, raise_at_min_scale=False, **args
        )
        for i, overflow in enumerate(overflows):
            ds.update_scale(overflow)
            ours.update(overflow)
            assert (ours.scale, ours.hysteresis_left) == (ds.cur_scale, ds.cur_hysteresis), i
    config = ds_scaler.LossScaleConfig(
        torch.float16,
        dynamic_loss_scale=True,
        static_loss_scale=1.0,
        dynamic_loss_args=for_ds_args(8, 5, 0.5),
        profile=ds_scaler.LossScaleProfile.UNFUSED,
    )
    fake_optimizer = SimpleNamespace(loss_scale_config=config, verbose=False)
    ours = for_deepspeed(
        {"initial_scale_power": 8, "loss_scale_window": 5, "min_loss_scale": 0.5}, 0
    )
    for i, overflow in enumerate(overflows):
        FP16_UnfusedOptimizer._update_scale(fake_optimizer, overflow)
        ours.update(overflow)
        assert ours.scale == config.cur_scale, i
    assert any(overflows) and not all(overflows)


def for_ds_args(power, window, floor):
    from deepspeed.runtime.fp16 import loss_scaler as ds_scaler

    return {
        ds_scaler.INITIAL_LOSS_SCALE: 2**power,
        ds_scaler.SCALE_WINDOW: window,
        ds_scaler.DELAYED_SHIFT: 2,
        ds_scaler.CONSECUTIVE_HYSTERESIS: False,
        ds_scaler.MIN_LOSS_SCALE: floor,
    }


# -- the loop, on one CPU process, in fp16 -------------------------------------------------------


def test_growth_step_divides_by_the_new_scale():
    """SGD with lr 1/8 on w * x (gradient 1). With window 1 and no overflow, the stable interval
    is the boundary's index, so every boundary after the first doubles the scale, before
    unscaling: each of those updates uses gradient 1/2 (DeepSpeed's order)."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.5)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.125}},
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 1},
    }
    loop = Fp16Loop(model, config)
    weights, scales = [], []
    for _ in range(3):
        loop.backward(loop(torch.ones(1, 1, dtype=torch.float16)).float().sum())
        loop.step()
        weights.append(loop.module.weight.item())
        scales.append(loop.loss_scale)
    assert scales == [16, 32, 64]
    # 0.5 - 1/8 * (16/16), then - 1/8 * (16/32), then - 1/8 * (32/64)
    assert weights == [0.375, 0.3125, 0.25]


@pytest.mark.parametrize("managed", [True, False])
@pytest.mark.parametrize("stage", [0, 1])
def test_forced_inf_skips_the_whole_window(stage, managed):
    """An inf in micro-batch 1 of step 2 (of 2 or of 3 micro-batches): that step leaves every
    parameter as it was, counts as skipped, does not step the scheduler, still advances
    global_steps and global_samples; the scale follows the stage's rule."""
    plan = [None, None, 1, None]
    micro_batches = None if managed else [2, 3, 3, 1]
    config = fp16_config(stage, managed, initial_scale_power=8, loss_scale_window=100)
    before = run_plan("gas_lab", config, plan[:2], micro_batches)
    after = run_plan("gas_lab", config, plan[:3], micro_batches)
    full = run_plan("gas_lab", config, plan, micro_batches)
    assert torch.equal(before.params, after.params)  # the whole window was dropped
    assert not torch.equal(after.params, full.params)  # and the next step trains again
    n = [2, 2, 2, 2] if managed else micro_batches
    samples = [2 * sum(n[: i + 1]) for i in range(4)]  # micro-batch of 2, one rank
    micro_steps = [2, 4, 6, 8] if managed else [1, 2, 3, 4]
    scale_after_skip = 128.0 if stage == 0 else 256.0  # stage 0 halves, ZeRO-1 spends hysteresis
    expected = [
        dict(scale=256.0, applied=True, skipped_steps=0, scheduler_steps=1),
        dict(scale=256.0, applied=True, skipped_steps=0, scheduler_steps=2),
        dict(scale=256.0, applied=False, skipped_steps=1, scheduler_steps=2),
        dict(scale=scale_after_skip, applied=True, skipped_steps=1, scheduler_steps=3),
    ]
    for i, (got, want) in enumerate(zip(full.steps, expected, strict=True)):
        want |= dict(global_steps=i + 1, global_samples=samples[i], micro_steps=micro_steps[i])
        assert got == want, i


def test_stage0_as_deepspeed_switch():
    """Stage 0 as DeepSpeed 0.19.8 runs it: the loss reaches backward unscaled."""
    config = fp16_config(0, True)
    as_ds = run_plan("gas_lab", config, [None])
    textbook = run_plan("gas_lab", config, [None], stage0_as_deepspeed=False)
    ratio = textbook.grad_after_first_backward / as_ds.grad_after_first_backward
    assert ratio == pytest.approx(2.0**8, rel=1e-2)


def test_sgd_updates_show_the_growth_step_and_the_stage0_trap_in_the_model():
    """gas_lab's model, one process: the true gradient is 1 and lr 1/8, so a right update is
    1/8. ZeRO-1: a step where the scale doubled uses half the gradient. Stage 0 as DeepSpeed
    runs it: the loss reaches backward() unscaled and every update is divided by the scale;
    a textbook stage 0 (the loss scaled) behaves as ZeRO-1."""
    zero1, stage0 = sgd_updates("gas_lab", 1), sgd_updates("gas_lab", 0)
    textbook = sgd_updates("gas_lab", 0, stage0_as_deepspeed=False)
    assert zero1["scale"] == stage0["scale"] == [16.0, 32.0, 64.0]
    assert [u * 8 for u in zero1["update"]] == [1.0, 0.5, 0.5]
    assert [u * 8 for u in stage0["update"]] == [1 / 16, 1 / 32, 1 / 64]
    assert (zero1["first_grad"], stage0["first_grad"]) == (16.0, 1.0)
    assert textbook == zero1
    tiny = {"loss_factor": 2.0**-30, "scale_power": 16, "steps": 1}
    assert sgd_updates("gas_lab", 0, **tiny)["first_grad"] == 0.0  # underflowed, unscaled
    assert sgd_updates("gas_lab", 1, **tiny)["first_grad"] == 2.0**-14


def lifted_updates(library, stage, **kw):
    with fp16_check_lifted():
        return sgd_updates(library, stage, **kw)


@pytest.mark.ranks
def test_deepspeed_fp16_engine_shows_the_growth_step_and_the_stage0_trap(cluster):
    """The same on DeepSpeed's fp16 engine (CPU check lifted): its updates, scales and first
    gradients equal the model's, at stages 0 and 1, and the tiny loss underflows at stage 0."""
    for stage in (0, 1):
        ds = cluster.run(lifted_updates, "deepspeed", stage, timeout=300)
        assert ds[0] == ds[1] == sgd_updates("gas_lab", stage)
    tiny = {"loss_factor": 2.0**-30, "scale_power": 16, "steps": 1}
    assert cluster.run(lifted_updates, "deepspeed", 0, **tiny)[0]["first_grad"] == 0.0
    assert cluster.run(lifted_updates, "deepspeed", 1, **tiny)[0]["first_grad"] == 2.0**-14


# -- against DeepSpeed's fp16 engine on 2 CPU ranks, its CPU fp16 check lifted --------------------


def compare_lifted(stage, managed):
    from gas_lab.measure.loss_scale import MICRO_BATCHES, PLAN, compare

    config = fp16_config(stage, managed)
    with fp16_check_lifted():
        return compare(config, PLAN, None if managed else MICRO_BATCHES, inf_rank=1, device="cpu")


@pytest.mark.ranks
@pytest.mark.parametrize("managed", [True, False])
@pytest.mark.parametrize("stage", [0, 1])
def test_matches_deepspeed_fp16_engine_on_cpu_ranks(cluster, stage, managed):
    """10 steps, infs forced on rank 1 only: both ranks skip the same steps (the overflow flag
    is reduced over ranks) and gas_lab's loop equals DeepSpeed's engine bit for bit."""
    results = cluster.run(compare_lifted, stage, managed, timeout=300)
    for r in results:
        assert r["steps_equal"], (r["gas_lab"], r["deepspeed"])
        assert r["max_abs_diff"] == 0.0
    steps = results[0]["deepspeed"]
    assert [s["applied"] for s in steps] == [T, T, F, T, T, T, F, F, T, T]
    assert steps[-1]["skipped_steps"] == 3 and steps[-1]["scheduler_steps"] == 7
    assert results[0]["gas_lab"] == results[1]["gas_lab"]  # the ranks agree


# -- against DeepSpeed's fp16 engine on a GPU -----------------------------------------------------


@pytest.fixture(scope="module")
def on_one_gpu():
    """All four comparisons in one child under torchrun with one rank (nccl, as a GPU job runs;
    the process group stays out of the test process)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd += ["-m", "gas_lab.measure.loss_scale"]
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # let it find the GPU
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("managed", [True, False])
@pytest.mark.parametrize("stage", [0, 1])
def test_matches_deepspeed_fp16_engine_on_gpu(on_one_gpu, stage, managed):
    r = on_one_gpu[f"stage {stage}, {'managed' if managed else 'unmanaged'}"]
    assert r["steps_equal"], (r["gas_lab"], r["deepspeed"])
    assert [s["applied"] for s in r["deepspeed"]] == [T, T, F, T, T, T, F, F, T, T]
    assert r["max_abs_diff"] <= 1e-3, r["max_abs_diff"]  # a few fp16 ulps, GPU kernels
    # The trap: at stage 0 DeepSpeed's first gradient is the unscaled one, at ZeRO-1 the scaled.
    ds_grad, textbook = r["grad_after_first_backward"]["deepspeed"], r["textbook_grad"]
    if stage == 0:
        assert textbook / ds_grad == pytest.approx(2.0**8, rel=1e-2)
    elif not managed:  # managed ZeRO-1 moves gradients out of .grad during backward
        assert ds_grad == pytest.approx(textbook, rel=1e-3)
