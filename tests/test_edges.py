"""Lesson 08's APIs, gas_lab against DeepSpeed 0.19.8 on 2 ranks (ZeRO stage 0 and 1, managed
and unmanaged): LR schedules, checkpoints resumed at a boundary and mid-window, and where the
mean divides by the world size, per ZeRO stage (0 to 2) and key. Both libraries run the same
functions of gas_lab.measure.replay, resume and mean_division."""

import itertools
import math
import os

import pytest
import torch

from gas_lab.deepspeed_compat import schedules

os.environ.setdefault("DS_ACCELERATOR", "cpu")
TOL = 1e-6
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    "steps_per_print": 10**9,
}
WARMUP = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4}}
DECAY = {
    "type": "WarmupDecayLR",
    "params": {"warmup_num_steps": 3, "total_num_steps": 7, "warmup_type": "linear"},
}
MODES = list(itertools.product((0, 1), (True, False)))  # (stage, managed)
RAGGED = [2, 3, 1, 2, 2, 4, 1, 2, 2]  # micro-batches per step (unmanaged; managed ignores it)


def make_config(stage, managed, **extra):
    return {**BASE, "zero_optimization": {"stage": stage},
            "managed_gradient_accumulation": managed, **extra}  # fmt: skip


# ---------------------------------------------------------------- 1. schedules, one process
@pytest.mark.parametrize(
    "name, params",
    [
        ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 5}),
        ("WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"}),  # forced to 2
        ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "cubic"}),  # unknown: log
        ("WarmupDecayLR", {"total_num_steps": 9, "warmup_num_steps": 3}),
        ("WarmupDecayLR", {"total_num_steps": 2, "warmup_num_steps": 4, "warmup_type": "linear"}),
        ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_min_ratio": 0.1}),
    ],
)
def test_schedules_equal_deepspeeds_classes(name, params):
    from deepspeed.runtime import lr_schedules

    def opt():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05)

    ours, theirs = (
        schedules.SCHEDULES[name][0](opt(), **params),
        getattr(lr_schedules, name)(opt(), **params),
    )
    seen = [(ours.optimizer.param_groups[0]["lr"], theirs.optimizer.param_groups[0]["lr"])]
    for i in range(16):
        kwargs = {"last_batch_iteration": 3} if i == 10 else {}  # lr_kwargs jump back
        ours.step(**kwargs)
        theirs.step(**kwargs)
        seen.append((ours.get_lr()[0], theirs.get_lr()[0]))
    assert all(a == b for a, b in seen), seen
    assert ours.state_dict() == theirs.state_dict()
    assert len({round(a, 9) for a, _ in seen}) >= 3  # the schedule really moved


def test_the_first_two_updates_use_warmup_min_lr():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05)
    sched = schedules.WarmupLR(opt, warmup_min_lr=0.002, warmup_max_lr=0.01, warmup_num_steps=4)
    used = []
    for _ in range(3):
        used.append(opt.param_groups[0]["lr"])  # the lr the next update runs with
        sched.step()
    assert used[:2] == [0.002, 0.002] and used[2] > 0.002


def test_scheduler_block_is_checked_when_the_config_is_read():
    from gas_lab.deepspeed_compat.config import load_config
    from gas_lab.errors import ConfigError, NotImplementedInGasLab

    cfg = {**BASE}
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps"):
        load_config({**cfg, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})
    with pytest.raises(ConfigError, match="scheduler.params.warmup_max"):
        load_config({**cfg, "scheduler": {"type": "WarmupLR", "params": {"warmup_max": 1.0}}})
    with pytest.raises(ConfigError, match="total_num_steps"):
        load_config({**cfg, "scheduler": {"type": "WarmupDecayLR", "params": {}}})
    with pytest.raises(ConfigError, match="neither"):
        load_config({**cfg, "scheduler": {"type": "Warmup", "params": {}}})
    with pytest.raises(NotImplementedInGasLab, match="deepspeed.initialize"):
        load_config({**cfg, "scheduler": {"type": "OneCycle", "params": {}}})


# ---------------------------------------------------------------- 2. schedules on 2 ranks
def _traces(cases):
    from gas_lab.measure import replay

    out = []
    for cfg, kw in cases:
        runs = {lib: replay.lr_trace(lib, cfg, RAGGED, **kw) for lib in ("gas_lab", "deepspeed")}
        out.append({lib: (r["lr_at_start"], r["trace"], r["params"]) for lib, r in runs.items()})
    return out


@pytest.mark.ranks
def test_schedules_step_where_deepspeed_steps_them(cluster):
    cases = [
        (make_config(stage, managed, scheduler=sched), {})
        for (stage, managed), sched in itertools.product(MODES, (WARMUP, DECAY))
    ]
    # lr_kwargs go to scheduler.step(**lr_kwargs) at the boundary only.
    cases.append(
        (make_config(0, True, scheduler=WARMUP), {"lr_kwargs": {"last_batch_iteration": 2}})
    )
    cases.append((make_config(1, False, scheduler=DECAY), {"lr_kwargs": lambda step: {"last_batch_iteration": 2 * step}}))  # fmt: skip
    for rank in cluster.run(_traces, cases, timeout=240):
        for (cfg, kw), run in zip(cases, rank, strict=True):
            (start, ours, params), (ds_start, theirs, ds_params) = run["gas_lab"], run["deepspeed"]
            assert start == ds_start == 0.0  # warmup_min_lr before any update
            assert ours == theirs  # lr, scheduler counter and engine counters after every step()
            assert (params - ds_params).abs().max().item() <= TOL
            if not kw:
                assert len({t["lr"] for t in theirs}) > 2  # the schedule moved
            if cfg["managed_gradient_accumulation"]:  # a non-boundary step() changes nothing
                for i in range(0, len(theirs), 2):
                    before = theirs[i - 1] if i else {"lr": start, "last_batch_iteration": -1}
                    for key in ("lr", "last_batch_iteration"):
                        assert theirs[i][key] == before[key]


def _client_schedulers():
    from gas_lab.measure import replay
    from gas_lab.toys import tiny_model

    out = {}
    for lib, stage in itertools.product(("gas_lab", "deepspeed"), (0, 1)):
        seen = {}

        def factory(optimizer, seen=seen):
            seen["got"] = type(optimizer).__name__
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (k + 1))

        cfg = make_config(
            stage, False, scheduler=WARMUP
        )  # the client scheduler wins over the block
        engine, _, _, sched = replay.build(lib, cfg, lr_scheduler=factory)
        trace = replay.play(engine, replay.events(False, [1, 2, 1]))
        # A scheduler object bound to ANOTHER optimizer: accepted, stepped, changes nothing.
        model = tiny_model(0)
        other = torch.optim.SGD(model.parameters(), lr=0.5)
        stray = torch.optim.lr_scheduler.LambdaLR(other, lambda k: 0.1**k)
        engine2, *_ = replay.build(lib, make_config(stage, True), model=model, lr_scheduler=stray)
        trace2 = replay.play(engine2, replay.events(True, [1, 1, 1, 1]))
        out[(lib, stage)] = (seen["got"], type(sched).__name__, [t["lr"] for t in trace],
                             stray.last_epoch, [t["lr"] for t in trace2])  # fmt: skip
    return out


@pytest.mark.ranks
def test_client_scheduler_wins_and_a_callable_gets_the_torch_optimizer(cluster):
    for out in cluster.run(_client_schedulers, timeout=120):
        for stage in (0, 1):
            ours, theirs = out[("gas_lab", stage)], out[("deepspeed", stage)]
            assert ours == theirs
            got, kind, lrs, stray_epochs, engine_lrs = theirs
            assert got == "AdamW" and kind == "LambdaLR"  # the raw optimizer, even at ZeRO-1
            assert lrs == [0.01 * (1.0 / k) for k in (2, 3, 4)]  # LambdaLR: base lr x lambda
            assert stray_epochs == 2 and set(engine_lrs) == {0.01}  # stepped, but useless


def _overflow(stage, bf16):
    from gas_lab.measure import replay

    cfg = make_config(stage, True, gradient_accumulation_steps=1, scheduler=DECAY)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    out = {}
    for lib in ("gas_lab", "deepspeed"):
        engine, *_ = replay.build(lib, cfg)
        trace = []
        for step in range(3):  # the loss of step 1 is infinite
            replay.play(engine, [("backward", step, 0)], loss_scale=math.inf if step == 1 else 1)
            trace += replay.play(engine, [("step", step)])
        params = replay.flat_params(engine.module)
        out[lib] = (trace, bool(torch.isfinite(params).all()), params)
    return out


@pytest.mark.ranks
@pytest.mark.parametrize("stage, bf16", [(0, False), (0, True), (1, False), (1, True)])
def test_a_skipped_update_does_not_step_the_scheduler(cluster, stage, bf16):
    for out in cluster.run(_overflow, stage, bf16, timeout=120):
        (ours, ours_finite, ours_p), (theirs, finite, params) = out["gas_lab"], out["deepspeed"]
        assert ours == theirs and ours_finite == finite
        iterations = [t["last_batch_iteration"] for t in theirs]
        if stage == 0 and not bf16:  # no overflow check at all: NaN weights, scheduler stepped
            assert not finite and iterations == [0, 1, 2] and theirs[-1]["skipped_steps"] == 0
        else:
            assert finite and torch.equal(ours_p, params)
            assert iterations == [0, 0, 1] and [t["applied"] for t in theirs] == [1, 0, 1]
            assert [t["skipped_steps"] for t in theirs] == [0, 1, 1]
            assert [t["global_steps"] for t in theirs] == [1, 2, 3]  # counted anyway


# ---------------------------------------------------------------- 3. checkpoints and resume
RESUME_N = [4, 4, 4, 4]
RESUME_CFG = {
    **BASE,
    "gradient_accumulation_steps": 4,
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                 "warmup_num_steps": 3, "warmup_type": "linear"}},
}  # fmt: skip


def _resume_table(root):
    from gas_lab.measure import resume

    rows = {}
    for stage, managed in MODES:
        cfg = {**RESUME_CFG, "zero_optimization": {"stage": stage},
               "managed_gradient_accumulation": managed}  # fmt: skip
        at = resume.save_points(managed, RESUME_N, window=2, after=2)
        plans = {"boundary": (at["boundary"], at["boundary"]), "mid, continue": (at["mid"], at["mid"]),
                 "mid, redo the window": (at["mid"], at["window_start"])}  # fmt: skip
        for where, (save, restart) in plans.items():
            for lib in ("gas_lab", "deepspeed"):
                folder = os.path.join(root, f"{lib}-{stage}-{managed}-{where}")
                rows[(stage, managed, where, lib)] = resume.resume(lib, cfg, RESUME_N, save, restart,
                                                                  folder)  # fmt: skip
    return rows


@pytest.mark.ranks
def test_resume_ends_where_deepspeed_ends(cluster, tmp_path):
    for rows in cluster.run(_resume_table, str(tmp_path), timeout=300):
        for stage, managed in MODES:
            for where in ("boundary", "mid, continue", "mid, redo the window"):
                ours, theirs = (
                    rows[(stage, managed, where, lib)] for lib in ("gas_lab", "deepspeed")
                )
                name = f"stage {stage}, {'managed' if managed else 'unmanaged'}, {where}"
                assert (ours["params"] - theirs["params"]).abs().max().item() <= TOL, name
                for key in ("saved_at", "after_load", "final", "reference"):
                    assert ours[key] == theirs[key], f"{name}: {key}"
                assert set(ours["client_state"]) == {"events_run"}  # exactly what was saved
                assert ours["client_state"]["events_run"] == theirs["client_state"]["events_run"]
                # What DeepSpeed restores: global_steps/samples, skipped; never micro_steps.
                assert theirs["after_load"]["micro_steps"] == 0
                assert theirs["after_load"]["global_steps"] == 2
                exact = where != "mid, continue"
                assert (theirs["diff_vs_uninterrupted"] <= TOL) == exact, name
                if not exact:  # the window's gradients are lost, and visibly so
                    assert theirs["diff_vs_uninterrupted"] > 1e-3
                    assert theirs["final"] != theirs["reference"]


def _checkpoint_edges(root):
    import torch.distributed as dist

    from gas_lab.measure import replay

    out = {}
    for lib in ("gas_lab", "deepspeed"):
        engine, *_ = replay.build(lib, make_config(1, True))
        empty = os.path.join(root, lib, "empty")
        os.makedirs(empty, exist_ok=True)
        dist.barrier()
        missing = engine.load_checkpoint(empty)  # no "latest": (None, None) and a warning
        folder = os.path.join(root, lib, "tagged")
        saved = engine.save_checkpoint(folder, tag="mytag", save_latest=False)
        without_tag = engine.load_checkpoint(folder)
        path, client = engine.load_checkpoint(folder, tag="mytag")
        out[lib] = (missing, saved, without_tag, path is not None, os.path.isfile(path))
    return out


@pytest.mark.ranks
def test_load_without_latest_returns_none_and_an_explicit_tag_loads(cluster, tmp_path):
    for out in cluster.run(_checkpoint_edges, str(tmp_path), timeout=120):
        assert out["gas_lab"] == out["deepspeed"] == ((None, None), True, (None, None), True, True)


# ---------------------------------------------------------------- 4. where the mean divides
# (stage, extra config, where DeepSpeed 0.19.8 divides by the world size): "before" the sum (each
# rank hands its all-reduce gradient / W), "after" it (the whole gradient, the sum multiplied by
# 1/W afterwards), "none" (the sum). Read from stage_1_and_2.py (average_tensor,
# gradient_reduction_w_predivide, allreduce_bucket) and engine.py (allreduce_bucket), and measured.
RS_FALSE = {"reduce_scatter": False}
DIVISION = [
    (0, {}, "after"),
    (0, {"prescale_gradients": True}, "before"),
    (0, {"gradient_predivide_factor": 2.0}, "before"),  # f = W: all of the division first
    (0, {"gradient_allreduce_op": "sum"}, "none"),
    (1, {}, "before"),
    (1, {"zero_optimization": RS_FALSE}, "after"),
    (1, {"zero_optimization": RS_FALSE, "prescale_gradients": True}, "before"),
    (1, {"zero_optimization": {"contiguous_gradients": False}}, "before"),
    (1, {"zero_optimization": {"use_multi_rank_bucket_allreduce": False}}, "before"),  # reduce
    (1, {"prescale_gradients": True}, "before"),
    (1, {"gradient_allreduce_op": "sum"}, "none"),
    (2, {}, "before"),
    (2, {"zero_optimization": RS_FALSE}, "after"),
    (2, {"gradient_allreduce_op": "sum"}, "none"),
]


def _divisions(cases):
    from gas_lab.measure import mean_division, replay

    return [replay.both(mean_division.division, extra, stage=stage) for stage, extra, _ in cases]


@pytest.fixture(scope="module")
def divisions(cluster):
    return cluster.run(_divisions, DIVISION, timeout=300)


@pytest.mark.ranks
def _name(stage, extra):
    keys = {**extra.get("zero_optimization", {}), **extra}
    keys.pop("zero_optimization", None)
    return f"stage{stage}-" + ("+".join(f"{k}={v}" for k, v in keys.items()) or "defaults")


@pytest.mark.ranks
@pytest.mark.parametrize("index", range(len(DIVISION)), ids=[_name(s, e) for s, e, _ in DIVISION])
def test_where_deepspeed_and_gas_lab_divide_by_the_world_size(divisions, index):
    stage, extra, where = DIVISION[index]
    for rank in divisions:
        ours, theirs = rank[index]["gas_lab"], rank[index]["deepspeed"]
        assert theirs["where"] == where, theirs
        # What each rank hands the all-reduce, against its own local gradient (W = 2).
        assert theirs["handed"] == (0.5 if where == "before" else 1.0)
        assert theirs["final"] == (1.0 if where == "none" else 0.5)  # the optimizer's: mean or sum
        if stage == 2 and extra.get("zero_optimization") == RS_FALSE:
            assert "out of gas_lab's scope" in ours["refused"]  # gas_lab's ZeRO-2: the default only
        else:
            assert ours == theirs  # handed, received (to the bit), place, collectives, calls


GRAD = 4 * 58  # lesson 05's model: 58 fp32 weights, one gradient of 232 bytes


def _lesson05_calls():
    from gas_lab.measure import mean_division, replay

    cases = ({}, {"use_multi_rank_bucket_allreduce": False}, {"reduce_scatter": False},
             {"reduce_scatter": False, "use_multi_rank_bucket_allreduce": False})  # fmt: skip
    return [
        replay.both(mean_division.division, {"zero_optimization": z}, stage=1, dims={})
        for z in cases
    ]


@pytest.mark.ranks
def test_which_collectives_carry_the_stage1_gradient(cluster):
    """Lesson 05's model, at ZeRO-1: by default one all-reduce of the whole gradient, divided
    first; use_multi_rank_bucket_allreduce false: a reduce of each owner's real elements (30
    and 28); reduce_scatter false: one all-reduce, divided after (the other key unread)."""
    want = [([("all_reduce", GRAD)], "before"), ([("reduce", 120), ("reduce", 112)], "before"),
            ([("all_reduce", GRAD)], "after"), ([("all_reduce", GRAD)], "after")]  # fmt: skip
    for rank in cluster.run(_lesson05_calls, timeout=300):
        for got, (calls, where) in zip(rank, want, strict=True):
            for lib in ("gas_lab", "deepspeed"):
                assert (got[lib]["calls"], got[lib]["where"]) == (calls, where), lib
            assert got["gas_lab"]["received"] == got["deepspeed"]["received"]  # to the bit


def _stage2_prescale():
    from gas_lab.measure import mean_division, replay

    return replay.both(mean_division.division, {"prescale_gradients": True}, stage=2)


@pytest.mark.ranks
def test_stage2_refuses_prescale_gradients_on_deepspeed(cluster):
    for out in cluster.run(_stage2_prescale, timeout=120):
        assert out["deepspeed"]["refused"].startswith("AssertionError: pre-scale gradients")


@pytest.mark.ranks
def test_gas_lab_refuses_prescale_gradients_at_stage2_too(cluster):
    """By its rule (prescale_stage2), at initialize as DeepSpeed, not as out of scope."""
    for out in cluster.run(_stage2_prescale, timeout=120):
        refused = out["gas_lab"].get("refused", "")
        assert refused.startswith("RejectedCombination: zero_optimization.stage=2 + prescale_"), out


@pytest.mark.parametrize(
    "extra, scaling",
    [({}, "divide_first"), ({"reduce_scatter": False}, "predivide"),
     ({"contiguous_gradients": False}, "divide_first"),
     ({"use_multi_rank_bucket_allreduce": False}, "divide_first")],
)  # fmt: skip
def test_the_stage1_bucket_plan_names_where_it_divides(extra, scaling):
    """The model in gas_lab/deepspeed_compat/buckets.py, without ranks: each collective of the
    plan carries the scaling of its DeepSpeed function, and the scaling's steps put the
    division before or after the sum."""
    from gas_lab.deepspeed_compat import buckets
    from gas_lab.deepspeed_compat.config import load_config

    cfg = load_config({**BASE, "zero_optimization": {"stage": 1, **extra}}, world_size=2)
    calls = buckets.stage1_calls([([(0, 40), (40, 8)], 24)], cfg.zero_optimization)
    assert calls and {c.scaling for c in calls} == {scaling}
    before, after = buckets.Division.of(cfg).steps(scaling, 2)
    grad = torch.ones(4)
    if scaling == "divide_first":
        assert after is None and torch.equal(before(grad.clone()), grad / 2)
    else:  # DeepSpeed's gradient_reduction_w_predivide: the sum first, times 1/W after
        assert before is None and torch.equal(after(grad.clone()), grad / 2)
    prescaled = load_config({**BASE, "prescale_gradients": True}, world_size=2)
    before, after = buckets.Division.of(prescaled).steps(scaling, 2)
    assert before is not None and after is None  # prescale_gradients: before, on either path
