"""The capstone's RL-style workload: ragged rollouts per rank, and the loss scaling that survives it.

In an RL trainer (or any RPC-driven backend) one optimizer step arrives as *whatever finished*:
each rank gets its own number of micro-batches, of sequences of their own lengths. With
``"managed_gradient_accumulation": false`` the trainer calls ``backward()`` once per micro-batch
and ``step()`` once; DeepSpeed then sums the gradients locally and *averages* them over ranks.

For the step to follow the gradient of the mean loss over every real token of every rank,
each micro-batch contributes ``sum of its token losses / T * W``: ``T`` the step's real tokens
summed over ranks (one all-reduce before the first backward), ``W`` the world size, which undoes
DeepSpeed's average over ranks. And ``backward(loss, scale_wrt_gas=False)``, or DeepSpeed also
divides by the config's ``gradient_accumulation_steps``, a number that means nothing here.

The same :class:`RolloutRun` runs in the notebook's ranks and in
``tutorials/scripts/train_unmanaged.py``; :func:`reference_run` is the answer both must reach.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from gas_lab.accumulate import Batch, Window, normalized_loss, token_losses
from gas_lab.deepspeed_compat.config import load_config
from gas_lab.dp import global_count
from gas_lab.toys import TinyTransformer, flat_params


# ---------------------------------------------------------------- the rollouts
@dataclass(frozen=True)
class RolloutSpec:
    """Shape of the toy rollouts: ``rows`` sequences per micro-batch, 1..max_micro of them."""

    rows: int = 4  # = train_micro_batch_size_per_gpu, which DeepSpeed's global_samples counts
    max_micro: int = 4
    max_len: int = 12
    vocab: int = 16


SPEC = RolloutSpec()


def rollouts(
    step: int, rank: int, seed: int = 0, spec: RolloutSpec = SPEC, n_micro: int | None = None
) -> list[Batch]:
    """The micro-batches ``rank`` gets in ``step``: deterministic from (seed, step, rank).

    ``n_micro`` None: a random count in 1..max_micro (what finished on this rank). Each
    (step, rank) also draws its own longest length, so ranks differ a lot in real tokens. The
    task: predict the previous token, which the attention must learn to look up.
    """
    g = torch.Generator().manual_seed((seed * 100_003 + step) * 1009 + rank)
    n = n_micro or int(torch.randint(1, spec.max_micro + 1, (1,), generator=g))
    longest = int(torch.randint(2, spec.max_len + 1, (1,), generator=g))
    out = []
    for _ in range(n):
        lengths = torch.randint(1, longest + 1, (spec.rows, 1), generator=g)
        mask = (torch.arange(spec.max_len) < lengths).long()
        x = torch.randint(1, spec.vocab, (spec.rows, spec.max_len), generator=g) * mask
        y = torch.nn.functional.pad(x[:, :-1], (1, 0))  # the previous token; 0 at the start
        out.append(Batch(x, y * mask, mask))  # padding: token 0, target 0, masked out
    return out


def to_device(mb: Batch, device) -> Batch:
    """The micro-batch on the engine's device (a no-op on the CPU)."""
    return Batch(mb.x.to(device), mb.y.to(device), mb.mask.to(device))


# ---------------------------------------------------------------- the loss scaling
#: How a micro-batch loss is scaled: the right way, and the two classic wrong ones.
SCALINGS = ("global_tokens", "microbatch-mean", "local_tokens", "global_tokens_sum")
#: Each pitfall of the capstone as (scaling, scale_wrt_gas); "none" is the correct loop.
PITFALLS = {
    "none": ("global_tokens", False),
    "microbatch-mean": ("microbatch-mean", False),
    "scale_wrt_gas": ("global_tokens", True),
    "local_tokens": ("local_tokens", False),
}
#: Right loops that are not lesson 07's: lesson 08's ``/ T`` with no ``x W``, for a config with
#: ``"gradient_allreduce_op": "sum"`` (the ranks' gradients are summed, not averaged).
VARIANTS = {"sum": ("global_tokens_sum", False)}


@dataclass(frozen=True)
class StepCounts:
    """What one step holds, counted before its first backward: this rank's and all ranks'."""

    local: Window  # this rank's micro-batches, samples, real tokens
    global_tokens: int  # real tokens of the step on every rank together
    world_size: int

    @classmethod
    def of(cls, micro_batches: list[Batch]) -> StepCounts:
        local = Window.of(micro_batches)
        world = dist.get_world_size() if dist.is_initialized() else 1
        # Every rank must call this (one all-reduce), before its first backward of the step.
        return cls(local, int(global_count(local.n_tokens)), world)


def micro_batch_loss(token_losses: Tensor, mask: Tensor, scaling: str, counts: StepCounts):
    """The scalar one micro-batch hands to ``engine.backward(..., scale_wrt_gas=False)``."""
    if scaling == "global_tokens":
        every_token = Window(counts.local.n_micro, counts.local.n_samples, counts.global_tokens)
        # x W: DeepSpeed divides the summed gradient by W; the step must be sum / T, not / (T*W).
        return normalized_loss(token_losses, mask, "token", every_token) * counts.world_size
    if scaling == "global_tokens_sum":  # "gradient_allreduce_op": "sum": nothing to undo
        every_token = Window(counts.local.n_micro, counts.local.n_samples, counts.global_tokens)
        return normalized_loss(token_losses, mask, "token", every_token)
    if scaling == "microbatch-mean":  # each micro-batch's own mean / this rank's count of them
        return normalized_loss(token_losses, mask, "microbatch-mean", counts.local)
    if scaling == "local_tokens":  # right on one rank; the ranks' means then weigh the same
        return normalized_loss(token_losses, mask, "token", counts.local)
    raise ValueError(f"unknown scaling {scaling!r}; choose from {SCALINGS}")


# ---------------------------------------------------------------- the training loop
def capstone_config(stage=1, managed=False, clip=0.0, lr=1e-2, spec=SPEC) -> dict:
    """The DeepSpeed config of the capstone (fp32; also valid for ``gas_lab.initialize``).

    ``gradient_accumulation_steps`` is the *nominal* count ``max_micro``: unmanaged, DeepSpeed
    reads it only to scale losses when ``scale_wrt_gas=True`` (the pitfall) and to size a
    micro-batch in ``global_samples``. ``gradient_clipping`` is explicit: DeepSpeed clips at
    1.0 when the key is missing. ``torch_adam``: no minutes-long fused-Adam build on a CPU.
    """
    return {
        "train_micro_batch_size_per_gpu": spec.rows,
        "gradient_accumulation_steps": spec.max_micro,
        "managed_gradient_accumulation": managed,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
        "steps_per_print": 10**9,  # DeepSpeed's own progress lines would drown ours
    }


class RolloutRun:
    """One training run on rollouts; call :meth:`step` once per optimizer step, on every rank.

    ``initialize`` is ``deepspeed.initialize`` or ``gas_lab.initialize``. Unmanaged (as the
    config says): every micro-batch gets a backward, then one ``step()``. Managed: the rank
    must run exactly ``gradient_accumulation_steps`` micro-batches, with a ``step()`` after each.
    """

    def __init__(self, initialize: Callable, config: dict, seed=0, pitfall="none", spec=SPEC):
        model = TinyTransformer(seed, spec.vocab, max_len=spec.max_len)
        self.engine, *_ = initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        self.seed, self.spec, self.pitfall = seed, spec, pitfall
        self.scaling, self.scale_wrt_gas = {**PITFALLS, **VARIANTS}[pitfall]
        self.managed = self.engine.managed_gradient_accumulation()
        self.device = next(self.engine.module.parameters()).device
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def step(self, step: int) -> dict:
        """Train on this step's rollouts; return the step's metrics (the same on every rank)."""
        gas = self.engine.gradient_accumulation_steps() if self.managed else None
        micro = rollouts(step, self.rank, self.seed, self.spec, n_micro=gas)
        counts = StepCounts.of(micro)  # before the first backward
        summed = 0.0  # this rank's loss sum, for the metrics
        for mb in micro:
            mb = to_device(mb, self.device)
            losses = token_losses(self.engine, mb)
            loss = micro_batch_loss(losses, mb.mask, self.scaling, counts)
            self.engine.backward(loss, scale_wrt_gas=self.scale_wrt_gas)
            summed += (losses.detach() * mb.mask).sum().double()
            if self.managed:
                self.engine.step()  # counts the micro-step; updates on the GAS-th one
        if not self.managed:
            self.engine.step()  # the boundary: all-reduce, then one update
        return {"step": step, **self._metrics(len(micro), counts, summed)}

    def _metrics(self, n_micro: int, counts: StepCounts, summed) -> dict:
        """One all_gather: (micro-batches, tokens, loss sum) of every rank."""
        mine = torch.tensor(
            [n_micro, counts.local.n_tokens, float(summed)], dtype=torch.float64, device=self.device
        )
        every = [mine.clone() for _ in range(counts.world_size)]
        if counts.world_size > 1:
            dist.all_gather(every, mine)
        every = torch.stack(every).cpu()
        return {
            "loss": (every[:, 2].sum() / counts.global_tokens).item(),  # before this update
            "micro_batches": every[:, 0].long().tolist(),
            "tokens": every[:, 1].long().tolist(),
            "global_steps": self.engine.global_steps,
            "global_samples": self.engine.global_samples,
        }

    def params(self) -> Tensor:
        return flat_params(self.engine.module)


def reference_run(config: dict, steps: int, world_size: int, seed=0, spec=SPEC) -> dict:
    """One process, no engine: every rank's rollouts of a step as ONE batch, per-token mean.

    The answer a correct :class:`RolloutRun` reaches on ``world_size`` ranks: the same
    optimizer as DeepSpeed builds from ``config``, clipped at its ``gradient_clipping`` (1.0
    if unset, DeepSpeed's default). Returns, per step: ``params`` (flat, after the update),
    ``losses`` (before it) and ``grad_norms`` (before clipping).
    """
    cfg = load_config(config, world_size=world_size)
    model = TinyTransformer(seed, spec.vocab, max_len=spec.max_len)
    optimizer = cfg.optimizer.torch_optimizer(model.parameters())
    n_micro = cfg.gradient_accumulation_steps if cfg.managed_gradient_accumulation else None
    out = {"params": [], "losses": [], "grad_norms": []}
    for step in range(steps):
        micro = [mb for r in range(world_size) for mb in rollouts(step, r, seed, spec, n_micro)]
        big = Batch(*(torch.cat([getattr(m, k) for m in micro]) for k in ("x", "y", "mask")))
        loss = normalized_loss(token_losses(model, big), big.mask, "token", Window.of([big]))
        loss.backward()
        clip = cfg.gradient_clipping if cfg.gradient_clipping > 0 else float("inf")
        out["grad_norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        out["params"].append(flat_params(model))
    return out


# ---------------------------------------------------------------- runs that live on the ranks
#: A notebook cell ends, its ranks live on: runs started here stay between calls, so that a
#: notebook can drive them one step per ``cluster.run`` and check every step.
LIVE_RUNS: dict[str, RolloutRun] = {}


def start_runs(runs: dict[str, tuple[Callable, dict, str]], seed: int = 0) -> list[str]:
    """On every rank: replace the live runs by ``{name: (initialize, config, pitfall)}``."""
    LIVE_RUNS.clear()
    for name, (initialize, config, pitfall) in runs.items():
        LIVE_RUNS[name] = RolloutRun(initialize, config, seed, pitfall)
    return list(LIVE_RUNS)


def step_runs(step: int) -> dict[str, dict]:
    """On every rank: one step of every live run (same order everywhere); metrics + params."""
    return {name: {**run.step(step), "params": run.params()} for name, run in LIVE_RUNS.items()}


def train(cluster, runs: dict[str, tuple[Callable, dict, str]], steps: int) -> dict[str, list]:
    """From the notebook: train ``runs`` side by side on the ranks, ``steps`` steps, with a
    progress bar; returns each run's metrics and parameters after every step (rank 0's, equal
    on every rank)."""
    from tqdm import tqdm

    cluster.run(start_runs, runs, timeout=300)  # the engines are built on the ranks and stay
    history = {name: [] for name in runs}
    # A text bar on stdout: live in JupyterLab, and its last state stays in the saved output.
    desc = f"{len(runs)} run{'s' if len(runs) > 1 else ''} x {steps} steps"
    for step in tqdm(range(steps), desc=desc, file=sys.stdout, ncols=80):
        per_rank = cluster.run(step_runs, step)  # one step of every run, on every rank
        for name in runs:
            assert all(r[name]["params"].equal(per_rank[0][name]["params"]) for r in per_rank)
            history[name].append(per_rank[0][name])
    return history


def drift(run: list[dict], against: list[dict]) -> list[float]:
    """The largest parameter difference between two runs' histories, after every step."""
    return [
        (a["params"] - b["params"]).abs().max().item() for a, b in zip(run, against, strict=True)
    ]


def record_step(
    library: str, config: dict, step: int, seed: int = 0, forward_s: float = 0.0
) -> list:
    """On every rank: the timeline of one step of a fresh run of ``library`` ("deepspeed" or
    "gas_lab") on ``step``'s rollouts, after one unrecorded step on the same rollouts (so that
    nothing of the first step's set-up is in it). ``forward_s`` makes each recorded forward
    longer (:func:`gas_lab.measure.recording.record`)."""
    from gas_lab.measure.parity import initializer
    from gas_lab.measure.recording import record

    run = RolloutRun(initializer(library), config, seed)
    run.step(step)
    with record(run.engine, forward_s=forward_s) as events:
        run.step(step)
    return events


# ---------------------------------------------------------------- figures of lesson 07
#: One colour per run of lesson 07, the right one green.
COLOURS = {"none": "seagreen", "microbatch-mean": "crimson", "scale_wrt_gas": "purple",
           "local_tokens": "darkorange"}  # fmt: skip


def plot_tokens(tokens_per_rank: list[list[int]]):
    """Real tokens of every rank at every step (top), and rank 0's share of the step's tokens,
    the weight its data should get, against 1/W, the weight a per-rank count gives it (bottom)."""
    import matplotlib.pyplot as plt

    world = len(tokens_per_rank[0])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True, layout="constrained")
    steps, width = torch.arange(len(tokens_per_rank)), 0.8 / world
    for r in range(world):
        offset = (r - (world - 1) / 2) * width
        top.bar(steps + offset, [t[r] for t in tokens_per_rank], width, label=f"rank {r}")
    top.set(ylabel="real tokens", title="tokens per step per rank: the rollouts decide")
    top.legend()
    bottom.plot(
        steps,
        [t[0] / sum(t) for t in tokens_per_rank],
        "o-",
        color=COLOURS["none"],
        label="rank 0's share of the step's tokens",
    )
    bottom.axhline(
        1 / world,
        color=COLOURS["local_tokens"],
        linestyle="--",
        label=f"1/{world}: its weight with a per-rank count",
    )
    bottom.set(ylim=(0, 1.3), xlabel="optimizer step", ylabel="weight of rank 0")
    bottom.legend(loc="upper center", ncol=2)
    return fig


def plot_pitfalls(losses: dict[str, list[float]], drifts: dict[str, list[float]]):
    """Top: each run's loss minus the right run's, on the same rollouts. Bottom: each run's
    parameter drift from the run it is compared with (log scale; dashed: no clipping)."""
    import matplotlib.pyplot as plt

    fig, (gap, drift_ax) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, layout="constrained")
    right = losses["none"]
    gap.axhline(0, color=COLOURS["none"], linewidth=2, label="none (the right loop)")
    for name, curve in losses.items():
        if name != "none":
            gap.plot(
                [a - b for a, b in zip(curve, right, strict=True)], color=COLOURS[name], label=name
            )
    gap.set(title="top: loss minus the right run's loss", ylabel="loss difference")
    gap.legend(ncol=2)
    for name, ds in drifts.items():
        base = name.split(",")[0]
        style = "--" if "no clipping" in name else "-"
        drift_ax.plot([max(d, 1e-9) for d in ds], style, color=COLOURS[base], label=name)
    drift_ax.set(
        title="bottom: parameter drift from the right run",
        xlabel="optimizer step",
        ylabel="max |param difference|",
        yscale="log",
    )
    drift_ax.legend(ncol=2)
    return fig
