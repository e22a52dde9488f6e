"""Tutorial 07 as a script: an RL-style loop with unmanaged gradient accumulation on DeepSpeed.

Each optimizer step, every rank trains on however many micro-batches of variable-length
sequences its rollouts produced (gas_lab.lessons.rollouts), one backward() each, then one step(). The
loss of each micro-batch is its summed token loss / the step's real tokens on ALL ranks x the
world size, passed as backward(loss, scale_wrt_gas=False).

    torchrun --standalone --nproc_per_node 2 tutorials/scripts/train_unmanaged.py      # 2 CPU ranks
    torchrun --standalone --nproc_per_node 8 tutorials/scripts/train_unmanaged.py      # 8 GPUs
    deepspeed --num_gpus 8 tutorials/scripts/train_unmanaged.py --ds-config my.json
    deepspeed --hostfile hosts tutorials/scripts/train_unmanaged.py                    # several nodes

The world size comes from the launcher. Rank 0 prints one JSON line per step and a final JSON
summary line (progress bar on stderr). Config precedence: --stage/--managed on the command line,
then --ds-config, then the course's config (gas_lab.lessons.rollouts.capstone_config). See
docs/scale_out.md for clusters.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from shm_buffers import remove_own_buffer
from tqdm.auto import tqdm

from gas_lab.dp import end_rank, init_from_env
from gas_lab.lessons import rollouts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--seed", type=int, default=0, help="model init and rollouts")
    parser.add_argument("--stage", type=int, choices=(0, 1), default=None, help="ZeRO stage")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--managed",
        dest="managed",
        action="store_true",
        default=None,
        help="DeepSpeed's default: GAS micro-batches per rank, step() after each",
    )
    mode.add_argument(
        "--unmanaged",
        dest="managed",
        action="store_false",
        default=None,  # neither flag: the config decides
        help="a variable number of micro-batches, one step() (the default)",
    )
    parser.add_argument("--ds-config", default=None, help="a DeepSpeed JSON config file")
    parser.add_argument(
        "--pitfall",
        choices=tuple(rollouts.PITFALLS),
        default="none",
        help="reproduce one of the capstone's pitfalls (none = the right loop)",
    )
    parser.add_argument("--save-params", default=None, help="rank 0 saves the final parameters")
    parser.add_argument("--local_rank", type=int, default=None, help="set by `deepspeed`; unused")
    return parser.parse_args()


def build_config(args: argparse.Namespace) -> dict:
    if args.ds_config:
        with open(args.ds_config) as f:
            config = json.load(f)
    else:
        config = rollouts.capstone_config()
    if args.stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.stage
    if args.managed is not None:
        config["managed_gradient_accumulation"] = args.managed
    return config


def main() -> None:
    args = parse_args()
    backend = init_from_env()  # nccl on GPUs, gloo (and DS_ACCELERATOR=cpu) otherwise
    import deepspeed  # after init_from_env: DeepSpeed picks its accelerator on import

    config = build_config(args)
    run = rollouts.RolloutRun(deepspeed.initialize, config, seed=args.seed, pitfall=args.pitfall)
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    for step in tqdm(range(args.steps), desc="train", disable=rank != 0):
        metrics = run.step(step)  # every rank: collectives inside
        if rank == 0:
            metrics["global_tokens"] = sum(metrics["tokens"])
            metrics["seconds"] = round(time.perf_counter() - t0, 3)
            print(json.dumps(metrics), flush=True)

    # Every rank saw different rollouts; equal parameters mean the gradients were averaged.
    params = run.params().to(run.device)
    others = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(others, params)
    spread = max((p - params).abs().max().item() for p in others)
    if rank == 0:
        if args.save_params:
            torch.save(params.cpu(), args.save_params)
        summary = {
            "summary": True,
            "backend": backend,
            "world_size": world,
            "stage": run.engine.zero_optimization_stage(),
            "managed": run.managed,
            "pitfall": args.pitfall,
            "steps": args.steps,
            "global_steps": run.engine.global_steps,
            "global_samples": run.engine.global_samples,
            "micro_steps": run.engine.micro_steps,
            "final_loss": metrics["loss"] if args.steps else None,
            "param_spread": spread,
            "params_sum": params.sum().item(),
            "seconds": round(time.perf_counter() - t0, 3),
        }
        print(json.dumps(summary), flush=True)
    remove_own_buffer(rank)  # what DeepSpeed's CPU op left in /dev/shm (`deepspeed` launcher)
    end_rank()  # skips a teardown that sometimes aborts after the work is done


if __name__ == "__main__":
    main()
