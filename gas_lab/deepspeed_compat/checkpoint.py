"""Checkpoints: what DeepSpeed 0.19.8 saves and restores, and what it silently does not.

``engine.save_checkpoint(save_dir, tag=None, client_state={})`` must be called on **every**
rank (there are barriers); ``engine.load_checkpoint(load_dir, tag=None)`` returns
``(path, client_state)``, or ``(None, None)`` with a warning when ``tag`` is None and there is
no ``latest`` file. Saved and restored, as in DeepSpeed: the module's weights, the optimizer
state (ZeRO-1: each rank its own shard, with its fp32 master shard), the scheduler's state and
the counters ``global_steps``, ``global_samples`` and ``skipped_steps``.

**Not saved, as in DeepSpeed:** ``micro_steps``, the unmanaged count of ``backward()`` calls
since the last ``step()``, and the gradients accumulated so far. A save *between* ``backward()``
and ``step()`` therefore resumes as if saved at the previous boundary, minus the gradients of
the window: it is exact only at a boundary (right after the boundary's ``step()``). The default
tag, ``global_step<N>``, is the same for both places, so nothing marks a mid-window save.

gas_lab's layout (DeepSpeed's is ``mp_rank_00_model_states.pt`` plus, at ZeRO-1,
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank; the files are not interchangeable)::

    <save_dir>/latest                        the tag (rank 0; save_latest=True)
    <save_dir>/<tag>/model_states.pt         rank 0: module, lr_scheduler, counters, client_state
    <save_dir>/<tag>/optim_states.pt         ZeRO stage 0: rank 0, the whole optimizer state
    <save_dir>/<tag>/optim_states_rank<r>.pt ZeRO stage 1: rank r, its shard (state + fp32 master)

Unlike DeepSpeed, the ``client_state`` returned is exactly the dict you saved (DeepSpeed also
returns its own leftover keys such as ``ds_config``). Taught in lesson 08
(``tutorials/08_edges.ipynb``).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

MODEL_FILE = "model_states.pt"


def _rank_and_world(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


def optimizer_file(stage: int, rank: int) -> str:
    return "optim_states.pt" if stage == 0 else f"optim_states_rank{rank}.pt"


def _check_tag(tag: str, group) -> None:
    """Every rank must save under the same tag (DeepSpeed checks it too, and warns)."""
    if group is None:
        return
    tags = [None] * dist.get_world_size(group)
    dist.all_gather_object(tags, tag, group=group)
    if len(set(tags)) > 1:
        warnings.warn(f"checkpoint tags differ across ranks: {tags}", stacklevel=3)


def save(engine, save_dir, tag=None, client_state=None, save_latest=True) -> bool:
    """``engine.save_checkpoint``: write a checkpoint of ``engine`` (call on every rank; exact
    only at a boundary, gradients are not saved); returns True like DeepSpeed."""
    group, strategy = engine.group, engine.strategy
    rank, world = _rank_and_world(group)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    _check_tag(tag, group)
    folder = os.path.join(save_dir, tag)
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
    _barrier(group)  # the folder exists before anyone writes into it
    stage = engine.zero_optimization_stage()
    if rank == 0:
        scheduler = engine.lr_scheduler
        torch.save(
            {
                "module": engine.module.state_dict(),
                "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
                "global_steps": engine.global_steps,
                "global_samples": engine.global_samples,
                "skipped_steps": engine.skipped_steps,
                "zero_stage": stage,
                "dp_world_size": world,
                "client_state": dict(client_state or {}),
            },
            os.path.join(folder, MODEL_FILE),
        )
    if stage >= 1 or rank == 0:  # ZeRO-1: every rank its shard; stage 0: one full copy
        torch.save(strategy_state(strategy), os.path.join(folder, optimizer_file(stage, rank)))
    if rank == 0 and save_latest:
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write(tag)
    _barrier(group)  # every file is written before anyone loads
    return True


def load(
    engine,
    load_dir,
    tag=None,
    load_module_strict=True,
    load_optimizer_states=True,
    load_lr_scheduler_states=True,
    load_module_only=False,
):
    """``engine.load_checkpoint``: restore weights, optimizer, scheduler and counters;
    ``(path, client_state)``, or ``(None, None)`` when ``tag`` is None and
    ``<load_dir>/latest`` does not exist (as DeepSpeed, with a warning)."""
    strategy = engine.strategy
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            warnings.warn(
                f"Unable to find latest file at {latest}; pass tag= to load a checkpoint "
                "saved with save_latest=False",
                stacklevel=3,
            )
            return None, None
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(load_dir, str(tag))
    path = os.path.join(folder, MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no gas_lab checkpoint at {path} (tag {tag!r})")
    state = torch.load(path, map_location="cpu", weights_only=False)
    stage = engine.zero_optimization_stage()
    if state["zero_stage"] != stage:
        raise ValueError(
            f"checkpoint {path} was saved at ZeRO stage {state['zero_stage']}, this engine runs "
            f"stage {stage}; gas_lab loads a checkpoint into the stage that wrote it"
        )
    engine.module.load_state_dict(state["module"], strict=load_module_strict)
    rank, _ = _rank_and_world(engine.group)
    if load_module_only or not load_optimizer_states:
        # The master weights come from the weights just loaded (rounded when bf16).
        load_strategy_state(strategy, None, load_optimizer_states=False)
    else:
        optim = os.path.join(folder, optimizer_file(stage, rank))
        load_strategy_state(strategy, torch.load(optim, map_location="cpu", weights_only=False))
    if load_module_only:
        return path, state["client_state"]
    if load_lr_scheduler_states and engine.lr_scheduler is not None:
        if state["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.skipped_steps = state["skipped_steps"]
    # micro_steps and the unmanaged backward() count stay as they are: DeepSpeed does not
    # save them (a fresh engine has 0), nor any accumulated gradient.
    return path, state["client_state"]


# -- what a strategy saves: the optimizer state and fp32 masters (ZeRO: this rank's shard) ------
def strategy_state(strategy) -> dict:
    """This rank's optimizer state, fp32 master weights included. At ZeRO stages 1 and 2 a
    rank's shard, with the layout it was cut with (a later load checks it): DeepSpeed writes
    the same two things into one ``zero_pp_rank_<r>`` file per rank."""
    groups = getattr(strategy, "groups", None)
    if groups is None:  # stage 0: everything, on every rank
        return {
            "optimizer": strategy.optimizer.state_dict(),
            "masters": getattr(strategy, "masters", None),
        }
    return {
        "optimizer": strategy.optimizer.state_dict(),
        "masters": [g.master.detach().clone() for g in groups],
        "layouts": [(g.layout.numels, g.layout.world_size) for g in groups],
    }


def load_strategy_state(strategy, state: dict | None, load_optimizer_states: bool = True) -> None:
    """Restore :func:`strategy_state`, after the module's weights were loaded. Without the
    optimizer state, the fp32 masters are rebuilt from the loaded weights (rounded when bf16),
    as DeepSpeed does; a shard cut for another layout is refused."""
    if load_optimizer_states:
        if (layouts := _layouts(strategy)) and [
            (tuple(n), w) for n, w in state["layouts"]
        ] != layouts:
            raise ValueError(
                f"this ZeRO checkpoint was cut for another world size or model "
                f"(saved {state['layouts']}, now {layouts}); gas_lab loads it only unchanged"
            )
        strategy.optimizer.load_state_dict(state["optimizer"])
    groups = getattr(strategy, "groups", None)
    with torch.no_grad():
        if groups is not None:
            saved = state["masters"] if load_optimizer_states else [None] * len(groups)
            for g, master in zip(groups, saved, strict=True):
                g.master.copy_(master if master is not None else g.flat[g.start : g.end])
        elif getattr(strategy, "masters", None) is not None:
            saved = state["masters"] if load_optimizer_states else strategy.params
            for master, value in zip(strategy.masters, saved, strict=True):
                master.copy_(value)


def _layouts(strategy) -> list:
    return [(tuple(g.layout.numels), g.layout.world_size) for g in getattr(strategy, "groups", [])]
