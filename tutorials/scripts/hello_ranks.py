"""Tutorial 00 as a script: the same code the notebook runs on its ranks, under a launcher.

    torchrun --standalone --nproc_per_node 2 tutorials/scripts/hello_ranks.py          # CPU: 2 gloo ranks
    torchrun --standalone --nproc_per_node 8 tutorials/scripts/hello_ranks.py          # a box with 8 GPUs
    deepspeed --num_gpus 8 tutorials/scripts/hello_ranks.py               # same, DeepSpeed's launcher

The launcher sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the script picks
nccl where GPUs exist and gloo otherwise. Rank 0 prints one JSON line with the result.
"""

import argparse
import json

import torch
import torch.distributed as dist

from gas_lab.dp import end_rank, init_from_env
from gas_lab.lessons import hello


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to train")
    parser.add_argument("--local_rank", type=int, default=None, help="set by `deepspeed`; unused")
    args = parser.parse_args()

    backend = init_from_env()
    greeting = hello.all_reduce_hello()
    result = hello.train_tiny_deepspeed(steps=args.steps)

    # Every rank trained on different data; equal parameters mean the gradients were averaged.
    params = result["params"].cuda() if backend == "nccl" else result["params"]
    others = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(others, params)
    spread = max((p - params).abs().max().item() for p in others)
    if dist.get_rank() == 0:
        summary = {k: result[k] for k in ("global_steps", "global_samples", "micro_steps")}
        print(
            json.dumps(
                {
                    "backend": backend,
                    "world_size": dist.get_world_size(),
                    "all_reduce": greeting["received"],
                    "param_spread": spread,
                    "params_sum": result["params"].sum().item(),
                    **summary,
                }
            )
        )
    end_rank()  # skips a teardown that sometimes aborts after the work is done


if __name__ == "__main__":
    main()
