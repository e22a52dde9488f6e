"""Lesson 07's workload: ragged rollouts, the global per-token scaling, and the script.

The reference everywhere is :func:`gas_lab.lessons.rollouts.reference_run`: one process, every rank's
rollouts of a step as one batch, the per-token mean loss, one optimizer step.
"""

import json

import pytest
import torch
from test_scripts import torchrun  # tests/ is on sys.path: pytest puts it there

from gas_lab.accumulate import (
    Batch,
    Window,
    compare_grads,
    full_batch_gradient,
    grads_of,
    token_losses,
)
from gas_lab.lessons import rollouts

STEPS = 6


# ---------------------------------------------------------------- one process
def test_rollouts_are_deterministic_ragged_and_right_padded():
    a, b = rollouts.rollouts(3, 1, seed=5), rollouts.rollouts(3, 1, seed=5)
    assert all(x.x.equal(y.x) and x.mask.equal(y.mask) for x, y in zip(a, b, strict=True))
    counts = {len(rollouts.rollouts(s, r)) for s in range(20) for r in range(2)}
    assert counts == set(range(1, rollouts.SPEC.max_micro + 1))  # every count happens
    tokens = [
        [sum(mb.n_tokens for mb in rollouts.rollouts(s, r)) for r in range(2)] for s in range(20)
    ]
    assert max(abs(t0 - t1) for t0, t1 in tokens) > 30  # ranks differ a lot in real tokens
    for mb in a:
        assert len(mb) == rollouts.SPEC.rows
        assert (mb.mask[:, 1:] <= mb.mask[:, :-1]).all()  # real tokens first, then padding
        assert (mb.x * (1 - mb.mask)).eq(0).all() and (mb.y * (1 - mb.mask)).eq(0).all()
        assert mb.y[:, 1:].eq(mb.x[:, :-1] * mb.mask[:, 1:]).all()  # target: previous token


def test_managed_rollouts_have_the_asked_count():
    assert len(rollouts.rollouts(0, 0, n_micro=3)) == 3


def test_causal_model_never_sees_the_padding():
    model = rollouts.TinyTransformer(0)
    mb = rollouts.rollouts(0, 0)[0]
    scrambled = mb.x + (1 - mb.mask) * torch.randint(1, 16, mb.x.shape)
    with torch.no_grad():
        diff = (model(mb.x) - model(scrambled)) * mb.mask.unsqueeze(-1)
    assert diff.abs().max() < 1e-6


def _simulated_step(world_size: int, scaling: str, step: int = 1, times_world=True):
    """Each simulated rank's gradient of its micro-batch losses, then DeepSpeed's mean over ranks."""
    per_rank = [rollouts.rollouts(step, r) for r in range(world_size)]
    total = sum(Window.of(mbs).n_tokens for mbs in per_rank)
    grads = []
    for mbs in per_rank:
        world = world_size if times_world else 1
        counts = rollouts.StepCounts(Window.of(mbs), total, world)
        model = rollouts.TinyTransformer(0)
        for mb in mbs:
            rollouts.micro_batch_loss(token_losses(model, mb), mb.mask, scaling, counts).backward()
        grads.append(grads_of(model))
    averaged = {k: sum(g[k] for g in grads) / world_size for k in grads[0]}
    every = [mb for mbs in per_rank for mb in mbs]
    big = Batch(*(torch.cat([getattr(m, k) for m in every]) for k in ("x", "y", "mask")))
    return averaged, full_batch_gradient(rollouts.TinyTransformer(0), big, token_losses)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_global_token_scaling_gives_the_big_batch_gradient(world_size):
    got, ref = _simulated_step(world_size, "global_tokens")
    assert compare_grads(got, ref).max_rel < 1e-5


def test_forgetting_times_world_size_divides_the_gradient_by_it():
    got, ref = _simulated_step(2, "global_tokens", times_world=False)
    assert compare_grads({k: 2 * v for k, v in got.items()}, ref).max_rel < 1e-5


@pytest.mark.parametrize("scaling", ["microbatch-mean", "local_tokens"])
def test_the_pitfall_scalings_are_off_when_ranks_differ(scaling):
    got, ref = _simulated_step(2, scaling)
    assert compare_grads(got, ref).max_rel > 0.05


def test_unknown_scaling_is_refused():
    mb = rollouts.rollouts(0, 0)[0]
    counts = rollouts.StepCounts(Window.of([mb]), mb.n_tokens, 1)
    with pytest.raises(ValueError, match="global_tokens"):
        rollouts.micro_batch_loss(torch.zeros(4, 12), mb.mask, "per_rank", counts)


def test_reference_clips_only_when_asked():
    free = rollouts.reference_run(rollouts.capstone_config(clip=0.0), 3, 2)
    clipped = rollouts.reference_run(rollouts.capstone_config(clip=0.5), 3, 2)
    assert free["losses"][0] == clipped["losses"][0]  # same data, same start
    assert min(free["grad_norms"]) > 0.5  # so clipping at 0.5 changes every step
    # Adam undoes most of a constant rescale, not a per-step one: a small but real change
    assert (free["params"][-1] - clipped["params"][-1]).abs().max() > 1e-4


def test_drift_and_the_figures():
    runs = [{"params": torch.zeros(3)}, {"params": torch.ones(3)}]
    assert rollouts.drift(runs, [{"params": torch.zeros(3)}] * 2) == [0.0, 1.0]
    fig = rollouts.plot_tokens([[5, 40], [30, 10], [12, 12]])
    assert len(fig.axes) == 2
    losses = {name: [1.0, 0.5] for name in rollouts.PITFALLS}
    fig = rollouts.plot_pitfalls(losses, {"microbatch-mean": [1e-3, 1e-2], "local_tokens": [0, 0]})
    assert [ax.get_yscale() for ax in fig.axes] == ["linear", "log"]


# ---------------------------------------------------------------- 2 ranks, real DeepSpeed
def _train(runs: dict, steps: int) -> dict:
    """On every rank: the named runs, ``{name: (library, config, pitfall)}``, side by side."""
    import deepspeed

    import gas_lab

    libraries = {"deepspeed": deepspeed.initialize, "gas_lab": gas_lab.initialize}
    rollouts.start_runs({n: (libraries[lib], c, p) for n, (lib, c, p) in runs.items()})
    history = [rollouts.step_runs(step) for step in range(steps)]
    return {name: [h[name] for h in history] for name in runs}


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.ranks
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_deepspeed_zero1_unmanaged_matches_the_reference_and_pitfalls_do_not(cluster, clip):
    config = rollouts.capstone_config(stage=1, clip=clip)
    runs = {p: ("deepspeed", config, p) for p in rollouts.PITFALLS}
    out = cluster.run(_train, runs, STEPS, timeout=300)
    ref = rollouts.reference_run(config, STEPS, world_size=2)
    right = out[0]["none"]
    for step, metrics in enumerate(right):
        assert metrics["params"].equal(out[1]["none"][step]["params"])  # ranks agree
        assert _max_diff(metrics["params"], ref["params"][step]) < 1e-5
        assert metrics["loss"] == pytest.approx(ref["losses"][step], abs=1e-5)
        n_micro = [len(rollouts.rollouts(step, r)) for r in range(2)]
        assert metrics["micro_batches"] == n_micro
    # DeepSpeed's global_samples is rank-local: this rank's backward() calls x micro x W.
    for rank in range(2):
        mine = sum(len(rollouts.rollouts(s, rank)) for s in range(STEPS))
        assert out[rank]["none"][-1]["global_samples"] == rollouts.SPEC.rows * 2 * mine
    drift = {p: _max_diff(out[0][p][-1]["params"], right[-1]["params"]) for p in rollouts.PITFALLS}
    assert drift["none"] == 0.0
    assert drift["microbatch-mean"] > 1e-3 and drift["local_tokens"] > 1e-3
    # scale_wrt_gas=True divides every gradient by GAS: plain Adam barely notices (eps),
    # clipping at 1.0 does (the bug clips at GAS x 1.0).
    if clip:
        assert drift["scale_wrt_gas"] > 1e-3
    else:
        assert 0 < drift["scale_wrt_gas"] < 1e-3


@pytest.mark.ranks
@pytest.mark.parametrize("stage", [0, 1])
def test_gas_lab_engine_matches_deepspeed_on_the_capstone_loop(cluster, stage):
    config = rollouts.capstone_config(stage=stage, clip=1.0)
    runs = {lib: (lib, config, "none") for lib in ("deepspeed", "gas_lab")}
    out = cluster.run(_train, runs, STEPS, timeout=300)[0]
    for step in range(STEPS):
        assert _max_diff(out["gas_lab"][step]["params"], out["deepspeed"][step]["params"]) < 1e-6
        assert out["gas_lab"][step]["global_samples"] == out["deepspeed"][step]["global_samples"]


# ---------------------------------------------------------------- the script under torchrun
@pytest.mark.ranks
def test_script_unmanaged_zero1_matches_the_reference(tmp_path):
    saved = tmp_path / "params.pt"
    out = torchrun("train_unmanaged.py", "--steps", str(STEPS), "--save-params", str(saved))
    assert out["summary"] and out["world_size"] == 2 and out["backend"] == "gloo"
    assert (out["stage"], out["managed"], out["global_steps"]) == (1, False, STEPS)
    assert out["param_spread"] == 0.0
    ref = rollouts.reference_run(rollouts.capstone_config(), STEPS, world_size=2)
    assert _max_diff(torch.load(saved), ref["params"][-1]) < 1e-5
    assert out["final_loss"] == pytest.approx(ref["losses"][-1], abs=1e-5)


@pytest.mark.ranks
def test_script_managed_with_a_config_file_matches_its_reference(tmp_path):
    config = rollouts.capstone_config(stage=1, clip=1.0)  # the file says stage 1 ...
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    saved = tmp_path / "params.pt"
    args = ["--steps", "3", "--ds-config", str(path), "--stage", "0", "--managed"]
    out = torchrun("train_unmanaged.py", *args, "--save-params", str(saved))
    assert (out["stage"], out["managed"]) == (0, True)  # ... the command line wins
    gas = config["gradient_accumulation_steps"]
    assert (out["global_steps"], out["micro_steps"]) == (3, 3 * gas)
    managed = {**config, "managed_gradient_accumulation": True, "zero_optimization": {"stage": 0}}
    ref = rollouts.reference_run(managed, 3, world_size=2)
    assert _max_diff(torch.load(saved), ref["params"][-1]) < 1e-5


# ---------------------------------------------------------------- the timeline of a ragged step
def _ragged_step(steps: int = 40) -> int:
    return max(
        range(steps), key=lambda s: abs(len(rollouts.rollouts(s, 0)) - len(rollouts.rollouts(s, 1)))
    )


@pytest.mark.ranks
@pytest.mark.parametrize("lib", ["deepspeed", "gas_lab"])
def test_the_rank_with_fewer_micro_batches_waits_inside_step(cluster, lib):
    """Lesson 07's picture: unmanaged at stage 1 nothing is reduced in backward(); the first
    collective inside step() is the gradient all_reduce, on both ranks, and the rank with fewer
    micro-batches spends longer in it (it arrived first and waited for the busy one)."""
    from gas_lab.measure.recording import calls, collectives

    step = _ragged_step()
    counts = [len(rollouts.rollouts(step, r)) for r in range(2)]
    assert abs(counts[0] - counts[1]) >= 2
    config = rollouts.capstone_config(stage=1, clip=0.0)
    forward_s = 0.02  # a bigger model's forward: the wait stands out from a shared CPU's noise
    events = [
        e for ev in cluster.run(rollouts.record_step, lib, config, step, forward_s=forward_s)
        for e in ev
    ]  # fmt: skip
    few, busy = sorted(range(2), key=lambda r: counts[r])
    for rank in (few, busy):
        assert len(calls(events, rank, "backward")) == counts[rank]
    assert not [c for c in collectives(events) if c.parent == "backward"]
    first = {r: next(c for c in collectives(events, r) if c.parent == "step") for r in (few, busy)}
    assert {c.kind for c in first.values()} == {"all_reduce"}
    assert first[few].bytes == first[busy].bytes
    durations = {r: c.end_ns - c.start_ns for r, c in first.items()}
    # the busy rank ran at least 2 more forwards while the other waited in the all-reduce
    assert durations[few] - durations[busy] > forward_s * 1e9, durations
