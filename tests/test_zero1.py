"""ZeRO-1 (gas_lab/zero1.py, gas_lab/measure/memory.py): the layout, one process against stage 0, and
2 ranks against DeepSpeed 0.19.8 stage 1 (parameters, counters, collectives, memory), including
coalesce_grad_reduction() and a direct loss.backward() (which only stage >= 1 accepts)."""

import functools

import pytest
import torch
from parity_support import ADAM, ADAMW, SGD, TOL, assert_same, run_case
from parity_support import config as shared_config

from gas_lab import initialize
from gas_lab.dp import clip_by_norm
from gas_lab.toys import micro_batch, tiny_model
from gas_lab.zero1 import ALIGNMENT, REDUCE_MODES, Layout, ShardedUpdate, global_norm


def config(optimizer, gas, managed=True, stage=1, **extra):
    return shared_config(optimizer, gas, managed, stage, **extra)


class PartlyFrozen(torch.nn.Module):
    """An odd number of trainable weights (not a multiple of W x ALIGNMENT), a frozen layer
    between them, and a parameter that never receives a gradient."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.frozen, self.b = (
            torch.nn.Linear(4, 5),
            torch.nn.Linear(5, 5),
            torch.nn.Linear(5, 2),
        )
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Parameter(torch.randn(5))

    def forward(self, x):
        return self.b(torch.tanh(self.frozen(torch.tanh(self.a(x)))))


# ---------------------------------------------------------------- the layout, on paper
@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("numels", [[58], [5, 3], [25, 25, 12, 5], [1], [7, 1, 1000, 3]])
def test_layout_covers_every_element_once(numels, world_size):
    layout = Layout.of(numels, world_size)
    unit = ALIGNMENT * world_size
    assert layout.padded_numel % unit == 0 and 0 <= layout.padding < unit
    assert layout.padded_numel == layout.numel + layout.padding == sum(numels) + layout.padding
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for rank in range(world_size):
        start, end = layout.shard(rank)
        assert end - start == layout.shard_size and start % ALIGNMENT == 0
        for i, lo, hi in layout.pieces(rank):
            assert layout.offsets[i] + lo >= start and layout.offsets[i] + hi <= end
            seen[i][lo:hi] += 1
    assert all((s == 1).all() for s in seen)  # every real element in exactly one shard


# ---------------------------------------------------------------- one process
def _train(stage, optimizer, managed, clip, n_per_step, model_fn=tiny_model):
    cfg = config(optimizer, 3, managed, stage, gradient_clipping=clip)
    model = model_fn(0)
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step, n in enumerate(n_per_step):
        for micro in range(n):
            x, y = micro_batch(0, step, micro, 0, 2)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            if managed:
                engine.step()
        if not managed:
            engine.step()
    return engine, opt


@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("managed, n_per_step", [(True, [3, 3, 3]), (False, [2, 5, 1, 3])])
@pytest.mark.parametrize("optimizer", [SGD, ADAMW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("model_fn", [tiny_model, PartlyFrozen], ids=["tiny", "partly-frozen"])
def test_stage_1_on_one_process_is_stage_0(managed, n_per_step, optimizer, clip, model_fn):
    zero, opt = _train(1, optimizer, managed, clip, n_per_step, model_fn)
    plain, _ = _train(0, optimizer, managed, clip, n_per_step, model_fn)
    assert isinstance(zero.strategy, ShardedUpdate) and zero.zero_optimization_stage() == 1
    assert [p for g in opt.param_groups for p in g["params"]] == zero.strategy.master_shards
    for (name, ours), theirs in zip(
        zero.module.named_parameters(), plain.module.parameters(), strict=True
    ):
        assert (ours - theirs).abs().max().item() <= TOL, name
    moved = [
        (p - q).abs().max()
        for p, q in zip(zero.module.parameters(), model_fn(0).parameters(), strict=True)
    ]
    assert max(moved) > 1e-3  # training did something


@pytest.mark.usefixtures("single_process")
def test_an_idle_step_is_refused_at_stage_1_only():
    """Unmanaged, a step() after no backward(): stage 0 steps on zeros, stage 1 refuses as
    DeepSpeed's ZeRO-1 fails (IndexError), naming the workaround (test_idle_rank.py)."""
    plain, _ = _train(0, SGD, False, 0.0, [2, 0, 1])
    assert plain.global_steps == 3
    with pytest.raises(IndexError, match="dummy micro-batch") as err:
        _train(1, SGD, False, 0.0, [2, 0, 1])
    assert err.value.rule.name == "idle_rank_stage1"


@pytest.mark.usefixtures("single_process")
def test_gradients_read_as_deepspeed_users_read_them():
    """deepspeed.utils.safe_get_full_grad: the local .grad before the boundary, the reduced
    gradient (fp32) between the boundary's reduction and step(), ValueError after it, as in
    DeepSpeed 0.19.8; destroy() takes the hook off the parameters."""
    from deepspeed.utils import safe_get_full_grad

    engine, _ = _train(1, ADAM, True, 0.0, [])
    params = list(engine.module.parameters())
    x, y = micro_batch(0, 0, 0, 0, 2)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))  # GAS 3: not the boundary
    local = [p.grad.clone() for p in params]
    assert all(torch.equal(safe_get_full_grad(p), g) for p, g in zip(params, local, strict=True))
    for micro in (1, 2):
        engine.step()
        x, y = micro_batch(0, 0, micro, 0, 2)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))  # the third reduces
    reduced = [safe_get_full_grad(p) for p in params]
    assert all(p.grad is None for p in params)  # only shards are left, as in DeepSpeed
    for g, p in zip(reduced, params, strict=True):
        assert g.dtype == torch.float32 and g.shape == p.shape
    full = torch.cat([g.flatten() for g in reduced])  # one rank: its shard is everything
    (group,) = engine.strategy.groups
    assert torch.equal(full, group.grad_shard[: full.numel()])
    engine.step()
    with pytest.raises(ValueError, match="only available immediately after backward"):
        safe_get_full_grad(params[0])
    engine.destroy()
    assert safe_get_full_grad(params[0]) is None and not hasattr(params[0], "_hp_mapping")


@pytest.mark.usefixtures("single_process")
def test_weights_are_views_of_the_flat_buffer():
    engine, _ = _train(1, ADAM, True, 1.0, [3])
    (group,) = engine.strategy.groups
    for p, offset in zip(group.params, group.layout.offsets, strict=True):
        assert p.data_ptr() == group.flat[offset:].data_ptr()  # no copy: the gather lands here
    assert torch.equal(group.flat[: group.layout.numel], group.master[: group.layout.numel])


def test_a_param_group_of_mixed_dtypes_is_refused():
    params = [
        torch.nn.Parameter(torch.zeros(3)),
        torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)),
    ]
    with pytest.raises(TypeError, match="one dtype"):
        ShardedUpdate(params, torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="reduce must be"):
        ShardedUpdate(params, torch.optim.SGD(params, lr=0.1), reduce="broadcast")


def test_sharded_clipping_without_a_group_is_torch_clipping():
    torch.manual_seed(0)
    grads = [torch.randn(7), torch.randn(4)]
    ref = [g.clone().requires_grad_() for g in grads]
    for r, g in zip(ref, grads, strict=True):
        r.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    norm = global_norm(grads)
    clip_by_norm(grads, norm, 0.5)
    assert abs(norm.item() - expected.item()) <= 1e-6 and norm.item() > 0.5
    for r, g in zip(ref, grads, strict=True):
        assert (r.grad - g).abs().max().item() <= 1e-7


# ---------------------------------------------------------------- 2 ranks: the global norm
def _sharded_clipping(max_norm):
    import torch.distributed as dist

    torch.manual_seed(3)  # the same full gradient on every rank; each keeps its own shard
    full = torch.randn(43)
    layout = Layout.of([43], dist.get_world_size())
    start, end = layout.shard(dist.get_rank())
    shard = torch.nn.functional.pad(full, (0, layout.padding))[start:end].clone()
    local_only = shard.norm().item()  # the mistake: a norm of this rank's shard only
    norm = global_norm([shard], dist.group.WORLD)
    clip_by_norm([shard], norm, max_norm)
    gathered = torch.empty(layout.padded_numel)
    dist.all_gather_into_tensor(gathered, shard)
    ref = full.clone().requires_grad_()
    ref.grad = full.clone()
    expected = torch.nn.utils.clip_grad_norm_([ref], max_norm)
    return norm.item(), expected.item(), local_only, (gathered[:43] - ref.grad).abs().max().item()


@pytest.mark.ranks
def test_clipping_uses_the_global_norm(cluster):
    for norm, expected, local_only, diff in cluster.run(_sharded_clipping, 1.0):
        assert abs(norm - expected) <= 1e-5 and norm > 1.0  # clipping really happened
        assert diff <= 1e-6  # == torch's clip_grad_norm_ on the whole gradient
        assert local_only < norm - 0.5  # a shard's own norm would clip too little


# ---------------------------------------------------------------- 2 ranks: == DeepSpeed
CASES = {
    "managed-sgd-gas3": (config(SGD, 3), {}),
    "managed-sgd-gas1-noclip": (config(SGD, 1, gradient_clipping=0.0), {}),
    "managed-adam-gas2": (config(ADAM, 2), {}),
    "managed-adam-gas2-noclip": (config(ADAM, 2, gradient_clipping=0.0), {}),
    "managed-adamw-gas3-clip0.05": (config(ADAMW, 3, gradient_clipping=0.05), {}),
    "unmanaged-sgd-varN": (config(SGD, 2, False), {"micro_batches": [1, 3, 2, 4], "steps": 4}),
    "unmanaged-sgd-varN-clip0.05": (
        config(SGD, 2, False, gradient_clipping=0.05),
        {"micro_batches": [3, 1, 2]},
    ),
    "unmanaged-adam-varN-noclip": (
        config(ADAM, 3, False, gradient_clipping=0.0),
        {"micro_batches": [2, 5, 1, 3], "steps": 4},
    ),
    "unmanaged-adamw-noscale-clip0.05": (
        config(ADAMW, 1, False, gradient_clipping=0.05),
        {"micro_batches": [3, 1, 2], "scale_wrt_gas": False},
    ),
    "unmanaged-adam-per-rank-N": (config(ADAM, 2, False), {"per_rank_n": True}),
}


@pytest.mark.ranks
@pytest.mark.parametrize("name", list(CASES))
def test_stage_1_matches_deepspeed(cluster, name):
    cfg, kw = CASES[name]
    assert_same(cluster.run(run_case, cfg, kw, timeout=120), name)


@pytest.mark.ranks
@pytest.mark.parametrize(
    "cfg, kw",
    [(config(ADAM, 2), {}), (config(SGD, 2, False), {"micro_batches": [2, 1, 3]})],
    ids=["managed-adam", "unmanaged-sgd-varN"],
)
def test_frozen_unused_and_uneven_match_deepspeed(cluster, cfg, kw):
    steps = 3
    results = cluster.run(run_case, cfg, {**kw, "model_fn": PartlyFrozen, "steps": steps})
    unused_bytes = PartlyFrozen(0).unused.numel() * 4
    for diff, counters, collectives, _ in results:
        assert diff <= TOL and counters["gas_lab"] == counters["deepspeed"]
        ours, theirs = collectives["gas_lab"], collectives["deepspeed"]
        assert ours["all_gather"] == theirs["all_gather"]
        assert ours["all_reduce"]["calls"] == theirs["all_reduce"]["calls"]
        # DeepSpeed sends only the gradients that exist; gas_lab also sends zeros for a
        # parameter without one, so that the ranks' buffers agree even when a parameter is
        # used on one rank only (DeepSpeed's gloo all-reduce then fails on mismatched sizes).
        extra = ours["all_reduce"]["bytes"] - theirs["all_reduce"]["bytes"]
        assert extra == steps * unused_bytes


def _step_without_backward():
    from gas_lab.measure.parity import deepspeed_initialize, train

    cfg, n = config(ADAM, 3, False), [2, 0, 5, 1]
    stage0 = {**cfg, "zero_optimization": {"stage": 0}}
    steps = {}
    for name, init, c in [
        ("gas_lab stage 0", initialize, stage0),
        ("deepspeed stage 0", deepspeed_initialize(), stage0),
        ("gas_lab stage 1", initialize, cfg),
        ("deepspeed stage 1", deepspeed_initialize(), cfg),
    ]:
        try:
            steps[name] = train(init, c, 4, n)[0].global_steps
        except IndexError as err:  # every rank idle: each fails alone, no rank is left waiting
            steps[name] = f"{type(err).__name__}: {err}"
    return steps


@pytest.mark.ranks
def test_a_step_without_backward(cluster):
    """Unmanaged, a step() after no backward() on every rank (N = 0 micro-batches): at stage 0
    both libraries step on zero gradients (test_parity.py compares the weights); at stage 1
    DeepSpeed 0.19.8 raises IndexError in its reduction on every rank, and gas_lab refuses
    with a RejectedCombination that is an IndexError too (caught as one here; rule
    idle_rank_stage1; one idle rank: tests/test_idle_rank.py)."""
    for steps in cluster.run(_step_without_backward, timeout=120):
        assert steps["gas_lab stage 0"] == steps["deepspeed stage 0"] == 4
        assert "list index out of range" in steps["deepspeed stage 1"]
        assert steps["gas_lab stage 1"].startswith(
            "RejectedCombination: managed_gradient_accumulation"
        )
        assert "list index out of range" in steps["gas_lab stage 1"]


def _sharded_initialize(mode):
    """gas_lab's initialize() with the reduction mode of ShardedUpdate chosen."""
    from gas_lab.deepspeed_compat.strategies import strategy_for

    return functools.partial(initialize, strategy=strategy_for(1, reduce=mode))


def _collectives(cfg, kw, steps):
    from gas_lab.measure.parity import deepspeed_initialize, train

    out, params = {}, {}
    for name, init in [
        ("deepspeed", deepspeed_initialize()),
        ("all_reduce", _sharded_initialize("all_reduce")),
        ("reduce_scatter", _sharded_initialize("reduce_scatter")),
    ]:
        engine, _, _, log = train(init, cfg, steps, **kw)
        out[name] = log.by_kind()
        params[name] = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    grad_bytes = sum(p.numel() * 4 for p in tiny_model(0).parameters())
    padded_bytes = Layout.of([grad_bytes // 4], 2).padded_numel * 4
    diff = (params["reduce_scatter"] - params["all_reduce"]).abs().max().item()
    return out, grad_bytes, padded_bytes, diff


@pytest.mark.ranks
@pytest.mark.parametrize(
    "cfg, kw",
    [
        (config(ADAM, 3), {}),
        (config(ADAM, 3, gradient_clipping=0.0), {}),
        (config(SGD, 2, False), {"micro_batches": [4, 1, 3]}),
        # DeepSpeed's reduce_scatter flag (default true) does not change stage 1's all-reduce
        (config(ADAM, 2, zero_optimization={"stage": 1, "reduce_scatter": False}), {}),
        (config(ADAM, 2, False, zero_optimization={"stage": 1, "reduce_scatter": True}), {}),
    ],
    ids=["managed-clip", "managed-noclip", "unmanaged-varN", "flag-false", "flag-true"],
)
def test_collectives_per_optimizer_step(cluster, cfg, kw):
    steps = 3
    for out, grad_bytes, padded_bytes, diff in cluster.run(
        _collectives, cfg, kw, steps, timeout=120
    ):
        # DeepSpeed stage 1: one all-reduce of the whole (unpadded) gradient, one 4-byte
        # all-reduce of the global norm (computed even with clipping off, unlike stage 0) and
        # one all-gather of the padded weights.
        gather = {"calls": steps, "bytes": steps * padded_bytes}
        assert out["deepspeed"] == {
            "all_reduce": {"calls": 2 * steps, "bytes": steps * (grad_bytes + 4)},
            "all_gather": gather,
        }
        assert out["all_reduce"] == out["deepspeed"]
        # reduce-scatter instead: each rank receives only its shard (of the padded gradient).
        assert out["reduce_scatter"] == {
            "reduce_scatter": {"calls": steps, "bytes": steps * padded_bytes},
            "all_reduce": {"calls": steps, "bytes": steps * 4},
            "all_gather": gather,
        }
        assert diff <= TOL  # and the same training


# ------------------------------------------- 2 ranks: coalescing and loss.backward() == DeepSpeed
def _loop_by_op(lib, cfg, loop, steps=2, n=None):
    """On a rank: a loop of ``steps`` steps on gas_lab or DeepSpeed; returns the parameters,
    the counters and, op by op, the collectives each call issued.

    ``loop``: "engine" (engine.backward), "direct" (loss.backward()) or "coalesce" (every
    backward() of a step inside one coalesce_grad_reduction() block). Managed, step() follows
    each micro-batch (after the block when coalescing); unmanaged, once per step.
    """
    import torch.distributed as dist

    from gas_lab.measure.comm import count_collectives
    from gas_lab.measure.parity import deepspeed_initialize
    from gas_lab.toys import flat_params

    init = initialize if lib == "gas_lab" else deepspeed_initialize()
    model = tiny_model(0)
    engine = init(model=model, model_parameters=model.parameters(), config=cfg)[0]
    managed, gas = engine.managed_gradient_accumulation(), engine.gradient_accumulation_steps()
    ops = []
    with count_collectives() as log:

        def call(name, fn, *args):
            fn(*args)
            ops.append((name, [c.kind for c in log.calls]))
            log.calls.clear()

        def backward(step, micro):
            x, y = micro_batch(0, step, micro, dist.get_rank(), 2)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            loss.backward() if loop == "direct" else engine.backward(loss)

        for step in range(steps):
            if loop == "coalesce":
                block = engine.coalesce_grad_reduction()
                call("enter", block.__enter__)
                for micro in range(n or gas):
                    call("backward", backward, step, micro)
                call("exit", block.__exit__, None, None, None)
                for _ in range(gas):
                    call("step", engine.step)
                continue
            for micro in range(n or gas):
                call("backward", backward, step, micro)
                if managed:
                    call("step", engine.step)
            if not managed:
                call("step", engine.step)
    counters = (engine.global_steps, engine.global_samples, engine.micro_steps)
    return flat_params(engine.module), counters, ops


def _both(cfg, loop, n=None):
    return {lib: _loop_by_op(lib, cfg, loop, n=n) for lib in ("gas_lab", "deepspeed")}


def _assert_same(ours, theirs):
    assert (ours[0] - theirs[0]).abs().max().item() <= TOL
    assert ours[1:] == theirs[1:]  # counters, and the collectives of every call


@pytest.mark.ranks
@pytest.mark.parametrize(
    "cfg",
    [config(ADAM, 2), config(SGD, 1, gradient_clipping=0.0), config(ADAMW, 3)],
    ids=["adam-gas2", "sgd-gas1-noclip", "adamw-gas3"],
)
def test_coalesce_grad_reduction_matches_deepspeed(cluster, cfg):
    ranks = cluster.run(_both, cfg, "coalesce", timeout=120)
    for out in ranks:
        _assert_same(out["gas_lab"], out["deepspeed"])
        ops = out["gas_lab"][2]
        # Inside the block nothing is reduced; leaving it reduces once (1 all-reduce); the
        # boundary step() then updates (norm all-reduce, all-gather); other step()s only count.
        assert all(kinds == [] for op, kinds in ops if op in ("enter", "backward"))
        assert [kinds for op, kinds in ops if op == "exit"] == [["all_reduce"]] * 2
        gas = cfg["gradient_accumulation_steps"]
        assert [kinds for op, kinds in ops if op == "step"] == (
            [[]] * (gas - 1) + [["all_reduce", "all_gather"]]
        ) * 2
    # The same training as the loop without the block, and the replicas agree on it.
    from gas_lab.toys import flat_params

    plain = cluster.run(_loop_by_op, "gas_lab", cfg, "engine", timeout=60)
    for out, ref in zip(ranks, plain, strict=True):
        ours = out["gas_lab"]
        assert (ours[0] - ref[0]).abs().max().item() <= TOL and ours[1] == ref[1]
    assert torch.equal(ranks[0]["gas_lab"][0], ranks[1]["gas_lab"][0])
    assert (ranks[0]["gas_lab"][0] - flat_params(tiny_model(0))).abs().max().item() > 1e-3


@pytest.mark.ranks
@pytest.mark.parametrize("managed, n", [(True, None), (False, 3)], ids=["managed", "unmanaged-N3"])
def test_direct_backward_matches_deepspeed(cluster, managed, n):
    cfg = config(SGD, 2, managed)
    for out in cluster.run(_both, cfg, "direct", n, timeout=120):
        _assert_same(out["gas_lab"], out["deepspeed"])
        steps, samples, _ = out["gas_lab"][1]
        # Both count samples in engine.backward() only: unmanaged, a direct backward adds none.
        assert steps == 2 and (samples == 0) == (not managed)
        # Managed, the boundary backward() reduces, as engine.backward() would.
        reduced = [op for op, kinds in out["gas_lab"][2] if op == "backward" and kinds]
        assert len(reduced) == (2 if managed else 0)


# ---------------------------------------------------------------- 2 ranks: memory
def _memory(optimizer):
    from gas_lab.measure.memory import measure
    from gas_lab.measure.parity import deepspeed_initialize, train

    out = {}
    for name, init in (("gas_lab", initialize), ("deepspeed", deepspeed_initialize())):
        for stage in (0, 1):
            engine, *_ = train(init, config(optimizer, 1, stage=stage), steps=1)
            out[name, stage] = measure(engine)
    return out


@pytest.mark.ranks
@pytest.mark.parametrize("optimizer", [ADAM, SGD], ids=["adam", "sgd-momentum"])
def test_stage_1_halves_the_optimizer_state(cluster, optimizer):
    n_tensors = len(list(tiny_model(0).parameters()))
    for mem in cluster.run(_memory, optimizer, timeout=120):
        for stage in (0, 1):
            assert mem["gas_lab", stage].state == mem["deepspeed", stage].state  # same tensors
            assert mem["gas_lab", stage].master_bytes == mem["deepspeed", stage].master_bytes
        zero, one = mem["gas_lab", 0], mem["gas_lab", 1]
        layout = Layout.of([zero.model_numel], 2)
        per_element = zero.state_bytes_per_element
        assert per_element == (8.0 if optimizer is ADAM else 4.0)
        assert (
            one.optimizer_numel == layout.shard_size and one.master_bytes == 4 * layout.shard_size
        )
        # Half of stage 0's element-wise state, plus this rank's share of the padding ...
        assert 2 * one.elementwise_bytes == zero.elementwise_bytes + per_element * layout.padding
        # ... and per-tensor counters: one per weight tensor at stage 0, one per shard at stage 1.
        counter = 4 if optimizer is ADAM else 0  # Adam's float32 "step"; SGD has none
        assert (zero.per_tensor_bytes, one.per_tensor_bytes) == (counter * n_tensors, counter)
        assert one.state_bytes < zero.state_bytes / 2 + per_element * layout.padding


@pytest.mark.parametrize("reduce", REDUCE_MODES)
def test_no_collective_renamed_by_torch_warns(monkeypatch, reduce):
    """torch 2.13 deprecated ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` (each call
    warns); ZeRO-1 calls both, and neither may print a FutureWarning above a lesson's output.
    Stand-ins for the two collectives (a group of one rank, no process group) warn as torch's do."""
    import warnings

    import torch.distributed as dist

    def renamed(name, copy):
        def collective(out, inp, group=None):
            warnings.warn(f"`torch.distributed.{name}` is deprecated", FutureWarning, stacklevel=2)
            copy(out, inp)

        return collective

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: t)
    for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, renamed(name, lambda out, inp: out.copy_(inp)))
    model = tiny_model(0)
    params = list(model.parameters())
    zero = ShardedUpdate(params, torch.optim.SGD(params, lr=0.1), group="one rank", reduce=reduce)
    model(torch.randn(3, 4)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        zero.reduce_gradients()
        zero.update()
