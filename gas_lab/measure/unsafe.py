"""UNSAFE TEACHING MODE: switch a rule off and measure the failure it prevents.

Never train with this. Lesson 06 uses it to show *why* each refusal in
:mod:`gas_lab.rules.refusals` exists: with the check skipped the run goes on, and a measurement
(ranks drifting apart, distance from the right weights, a count of all-reduces) shows what goes
wrong. Most failures are silent (wrong weights, no error); some cost communication; some crash
later than the refusal would have (each rule's ``prevents`` says which).

:func:`initialize` builds gas_lab's engine with the named rules skipped (through the engine's one
public :meth:`check`), plus the boundary-gated work DeepSpeed would do for the feature the rule
was guarding:

* ``overlap_comm`` at ZeRO >= 1 reduces *inside backward()*, and only in the backward() of the
  boundary micro-batch; step() then trusts that it did.
* like DeepSpeed's engine, step() reduces only at a boundary and never inside ``no_sync()``.
* a direct ``loss.backward()`` at stage 0 is divided by GAS by the output hook, but nothing
  sees it end, so its boundary reduction never runs (DeepSpeed has no hook for it there).
* two features this machine cannot run are **models** read from DeepSpeed's source, not
  DeepSpeed (appendix A4 shows them, labelled so): ``DeepCompile`` (at stage 0 DeepSpeed falls
  back to torch.compile, which changes nothing here; at ZeRO-1 every backward() that is not the
  boundary empties the optimizer's averaged gradients, ``deepspeed/compile/init_z1_and_2.py``,
  so step() finds none and raises ``KeyError``) and Apex ``amp`` (it multiplies the loss by a
  loss scale and divides the gradients by it again only in the backward() of the boundary
  micro-batch, ``delay_unscale`` on all the others).

:func:`deepspeed_initialize`, :func:`pretend_managed` and :func:`allow_tensor_backward` do the
same to *real* DeepSpeed, so a lesson can check that this model of the failure matches what
DeepSpeed itself does. :func:`run` is lesson 06's loop on either library and :func:`experiment`
runs it on a notebook's ranks and compares (:class:`Outcome`).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gas_lab.deepspeed_compat.config import load_config
from gas_lab.deepspeed_compat.engine import DeepSpeedEngine
from gas_lab.deepspeed_compat.strategies import DeepSpeedStrategy, strategy_for
from gas_lab.dp import default_group
from gas_lab.rules import refusals

BANNER = "UNSAFE TEACHING MODE: rules skipped: {}. Never train with this engine."
# Skipping a rule about a feature gas_lab leaves out also lets that feature past scope checks.
_ALSO_SKIP = {"unmanaged_deepcompile": {"deepcompile"}}


def _with_scope(skip: set[str]) -> set[str]:
    """``skip`` plus the out-of-scope entries its rules' features need (DeepCompile's)."""
    return skip.union(*(_ALSO_SKIP.get(name, set()) for name in skip))


class GatedReduction:
    """Wraps the engine's update strategy (a :class:`DeepSpeedStrategy`): decides whether a
    reduction really happens, and hands every other call to the strategy it wraps."""

    def __init__(self, inner: DeepSpeedStrategy, engine: UnsafeEngine):
        self.inner, self.engine = inner, engine
        self.optimizer = inner.optimizer
        self.done = self.skipped = 0  # reductions run / reductions a feature swallowed

    def reduce_gradients(self) -> None:
        e = self.engine
        if e.inside_step:  # unmanaged step(): DeepSpeed reduces only at a boundary, outside
            # no_sync(), and not at all when a feature owns the reduction inside backward()
            if not e.reduces_now() or e.reduces_in_backward_only:
                self.skipped += 1
                return
        self.done += 1
        self.inner.reduce_gradients()

    def after_backward(self) -> None:
        self.inner.after_backward()

    def update(self) -> bool:
        return self.inner.update()

    @property
    def last_norm(self) -> float | None:
        return self.inner.last_norm

    def before_backward(self) -> None:
        self.inner.before_backward()

    def defer_reduction(self, deferred: bool) -> None:
        self.inner.defer_reduction(deferred)

    def destroy(self) -> None:
        self.inner.destroy()


class UnsafeEngine(DeepSpeedEngine):
    """gas_lab's engine with ``skipped`` rules off (through its one :meth:`check`) and the
    skipped features' backward() work."""

    def __init__(self, module, optimizer, config, group, strategy, skipped, loss_scale):
        super().__init__(module, optimizer, config, group, strategy)
        self.skipped = frozenset(skipped)
        zero = config.zero_optimization
        # At stage 0 DeepSpeed ignores overlap_comm (there is no ZeRO optimizer to overlap).
        self.reduces_in_backward_only = zero.overlap and zero.stage >= 1
        # DeepCompile is active at ZeRO 1-3 only; at ZeRO-1 only a boundary backward() leaves
        # averaged gradients for step() (a non-boundary one empties them).
        self.deepcompile_zero1 = config.compile.deepcompile and zero.stage == 1
        self._averaged_by_backward = False
        self.loss_scale = loss_scale if config.amp is not None else None
        self.strategy = GatedReduction(self.strategy, self)

    @property
    def reductions(self) -> dict[str, int]:
        return {"done": self.strategy.done, "skipped": self.strategy.skipped}

    def check(self, op: str) -> None:
        with refusals.skipping(self.skipped):
            super().check(op)

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        boundary = self.is_gradient_accumulation_boundary() and not self.inside_no_sync_ctxt
        self._averaged_by_backward = self.is_gradient_accumulation_boundary()
        if self.loss_scale is not None:
            loss = loss * self.loss_scale  # Apex: scale up so small fp16 gradients survive
        out = super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        if self.loss_scale is not None:
            if boundary:  # Apex unscales only when it is told this backward() ends the step
                for p in self.module.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.loss_scale)
            out = out / self.loss_scale
        return out

    def direct_backward_ended(self) -> None:
        if self.zero_optimization_stage() == 0:  # DeepSpeed: no hook sees the end
            return
        super().direct_backward_ended()

    def step(self, lr_kwargs=None):
        if self.deepcompile_zero1 and not self.managed_gradient_accumulation():
            if not self._averaged_by_backward:  # DeepSpeed's ZeRO-1 step() reads
                raise KeyError(0)  # averaged_gradients[0], which no backward() set
        return super().step(lr_kwargs)


def initialize(
    model, config: dict, skip: Iterable[str], loss_scale: float = 2.0**16, group=None, quiet=False
):
    """gas_lab's ``initialize`` with the rules named in ``skip`` switched off (UNSAFE).

    Returns ``(engine, optimizer, None, None)`` like :func:`gas_lab.initialize`.
    ``loss_scale`` is the Apex-style scale used when the config has an ``amp`` block.
    """
    skip = set(skip)
    known = {r.name for r in refusals.RULES} | {o.name for o in refusals.OUT_OF_SCOPE}
    if skip - known:
        raise ValueError(f"unknown rules {sorted(skip - known)}; choose from {sorted(known)}")
    skip = _with_scope(skip)
    group = group if group is not None else default_group()
    world_size = dist.get_world_size(group) if group is not None else 1
    with refusals.skipping(skip):
        cfg = load_config(config, world_size=world_size)
    if cfg.amp is not None and cfg.zero_optimization.stage > 0:
        raise ValueError("Apex AMP never worked with ZeRO; model it at stage 0 only")
    optimizer = cfg.optimizer.torch_optimizer(model.parameters())
    strategy = strategy_for(cfg.zero_optimization.stage)
    engine = UnsafeEngine(model, optimizer, cfg, group, strategy, skip, loss_scale)
    if not quiet and (group is None or dist.get_rank(group) == 0):
        print(BANNER.format(", ".join(sorted(skip))))
    return engine, engine.optimizer, None, None


def deepspeed_initialize(model, config: dict):
    """Real ``deepspeed.initialize`` with its unmanaged-mode checks bypassed (UNSAFE).

    DeepSpeed checks ``managed_gradient_accumulation`` once, at initialize: build the engine
    as managed, then switch the flag. Use :func:`pretend_managed` around later calls.
    """
    from gas_lab.measure.parity import deepspeed_initialize as ds_initialize

    unmanaged = config.get("managed_gradient_accumulation", True) is False
    config = {**config, "managed_gradient_accumulation": True}
    engine, optimizer, _, scheduler = ds_initialize()(
        model=model, model_parameters=model.parameters(), config=config
    )
    engine._config.managed_gradient_accumulation = not unmanaged
    return engine, optimizer, None, scheduler


def allow_tensor_backward(ds_engine):
    """Let a direct ``loss.backward()`` past DeepSpeed's stage-0 refusal (UNSAFE).

    Its output hooks then divide the gradient by GAS, as at stages 1-3, but at stage 0 no hook
    sees the backward end, so the boundary all-reduce never runs. Returns ``ds_engine``.
    """
    ds_engine._support_torch_style_backward = True
    return ds_engine


@contextlib.contextmanager
def pretend_managed(ds_engine):
    """Inside the block a DeepSpeed engine looks managed, so call-time checks let it pass."""
    saved = ds_engine._config.managed_gradient_accumulation
    ds_engine._config.managed_gradient_accumulation = True
    try:
        yield
    finally:
        ds_engine._config.managed_gradient_accumulation = saved


def params_spread(flat_per_rank: list[torch.Tensor]) -> float:
    """How far the ranks' replicas are apart: ``max |rank r - rank 0|`` over all parameters."""
    return max((f - flat_per_rank[0]).abs().max().item() for f in flat_per_rank)


# ---------------------------------------------------------------- lesson 06's experiments
LIBRARIES = ("gas_lab", "deepspeed")
# The rules whose DeepSpeed check these bypasses get past (the others run on gas_lab only).
DEEPSPEED_BYPASSES = frozenset(
    {"unmanaged_overlap_comm", "unmanaged_set_boundary", "tensor_backward_stage0"}
)


@dataclass
class Run:
    """What :func:`run` leaves on one rank."""

    params: torch.Tensor  # the rank's parameters at the end, flat
    events: list  # its engine calls and collectives (gas_lab.measure.recording.Event)
    updates: int  # engine.global_steps

    def collectives(self) -> Counter:
        """``{(kind, bytes): calls}`` over the run (kind: all_reduce, all_gather, ...)."""
        return Counter((e.kind, e.bytes) for e in self.events if e.cat == "collective")


def run(
    library: str,
    config: dict,
    skip: Iterable[str] = (),
    *,
    steps: int = 2,
    micro_batches: int = 3,
    set_boundary: bool | None = None,
    step_in_no_sync: bool = False,
    tensor_backward: bool = False,
) -> Run:
    """Lesson 06's loop on this rank (call on every rank), on ``library`` with ``skip`` off.

    ``steps`` optimizer steps of ``micro_batches`` micro-batches each: unmanaged, one
    ``step()`` after them; managed, ``step()`` after every micro-batch. With nothing skipped the
    library's own ``initialize`` builds the engine (the safe baseline); gas_lab with rules
    skipped is :func:`initialize`, DeepSpeed gets the bypasses of :data:`DEEPSPEED_BYPASSES`.
    ``set_boundary``: call ``set_gradient_accumulation_boundary(set_boundary)`` before every
    micro-batch; ``step_in_no_sync``: the whole step, ``step()`` included, inside ``no_sync()``;
    ``tensor_backward``: ``loss.backward()`` instead of ``engine.backward(loss)``.
    """
    from gas_lab.deepspeed_compat.engine import initialize as gas_initialize
    from gas_lab.measure.parity import deepspeed_initialize as ds_initialize
    from gas_lab.measure.parity import quiet_deepspeed
    from gas_lab.measure.recording import record
    from gas_lab.toys import flat_params, micro_batch, tiny_model

    skip, bypass = set(skip), contextlib.nullcontext
    if library not in LIBRARIES:
        raise ValueError(f"library {library!r}: choose from {LIBRARIES}")
    if library == "deepspeed" and skip - DEEPSPEED_BYPASSES:
        raise ValueError(
            f"DeepSpeed's checks for {sorted(skip - DEEPSPEED_BYPASSES)} cannot be "
            "bypassed here: run them on gas_lab"
        )
    rank, model = dist.get_rank(), tiny_model(0)
    if library == "gas_lab" and skip:
        engine = initialize(model, config, skip, quiet=True)[0]
    elif library == "gas_lab":
        engine = gas_initialize(model=model, config=config)[0]
    elif skip:
        engine = deepspeed_initialize(model, config)[0]
        bypass = functools.partial(pretend_managed, engine)
        if "tensor_backward_stage0" in skip:
            allow_tensor_backward(engine)
    else:
        engine = ds_initialize()(model=model, model_parameters=model.parameters(), config=config)[0]
    managed = engine.managed_gradient_accumulation()
    with record(engine) as events, quiet_deepspeed():
        for step in range(steps):
            with engine.no_sync() if step_in_no_sync else contextlib.nullcontext():
                for m in range(micro_batches):
                    if set_boundary is not None:
                        with bypass():
                            engine.set_gradient_accumulation_boundary(set_boundary)
                    x, y = micro_batch(0, step, m, rank, engine.train_micro_batch_size_per_gpu())
                    loss = torch.nn.functional.mse_loss(engine(x), y)
                    loss.backward() if tensor_backward else engine.backward(loss)
                    if managed:
                        engine.step()
                if not managed and step_in_no_sync:
                    engine.step()  # the refused call, inside the block
            if not managed and not step_in_no_sync:
                engine.step()
    return Run(flat_params(engine.module), events, engine.global_steps)


@dataclass
class Outcome:
    """One experiment, as lesson 06 prints it: how far apart the ranks ended, how far from the
    right weights, the collectives and updates, and whether DeepSpeed did exactly the same."""

    name: str
    spread: float  # max |rank r - rank 0| over every weight
    error: float  # max |rank 0 - reference|
    collectives: Counter  # rank 0's {(kind, bytes): calls}
    updates: int
    same_as_deepspeed: bool | None  # parameters equal (torch.equal), same collectives, updates
    runs: dict = field(repr=False, default_factory=dict)  # library -> [Run per rank]

    def __str__(self) -> str:
        comm = (
            ", ".join(
                f"{n} {kind} of {size} B" for (kind, size), n in sorted(self.collectives.items())
            )
            or "none"
        )
        same = {None: "not run", True: "yes", False: "NO"}[self.same_as_deepspeed]
        return (
            f"{self.name}\n    ranks apart {self.spread:.1e} | from the right weights "
            f"{self.error:.1e} | updates {self.updates} | same as DeepSpeed: {same}\n"
            f"    collectives on rank 0: {comm}"
        )


def experiment(
    cluster, name: str, config: dict, skip: Iterable[str] = (), libraries=LIBRARIES, **loop
) -> Outcome:
    """:func:`run` on the notebook's ranks for each of ``libraries``, compared with the right
    weights: one process taking every rank's micro-batches of a step in one mean, without any
    rule (the reference of :func:`gas_lab.measure.parity.reference_params`)."""
    from gas_lab.measure.parity import reference_params

    runs = {
        lib: cluster.run(run, lib, config, list(skip), **loop, timeout=120) for lib in libraries
    }
    steps, n = loop.get("steps", 2), loop.get("micro_batches", 3)
    with refusals.skipping(_with_scope(set(skip))):  # a config the rule would refuse
        reference = reference_params(config, steps, [n] * steps)
    ours = runs[libraries[0]]
    same = None
    if "deepspeed" in runs and libraries[0] != "deepspeed":
        same = all(
            torch.equal(a.params, b.params)
            and a.updates == b.updates
            and a.collectives() == b.collectives()
            for a, b in zip(ours, runs["deepspeed"], strict=True)
        )
    return Outcome(
        name,
        spread=params_spread([r.params for r in ours]),
        error=(ours[0].params - reference).abs().max().item(),
        collectives=ours[0].collectives(),
        updates=ours[0].updates,
        same_as_deepspeed=same,
        runs=runs,
    )
