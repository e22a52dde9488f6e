"""Tutorial 00 as a script: the same code the notebook runs on its ranks, under a launcher.

    torchrun --standalone --nproc_per_node 2 tutorials/scripts/hello_ranks.py          # CPU: 2 gloo ranks
    torchrun --standalone --nproc_per_node 8 tutorials/scripts/hello_ranks.py          # a box with 8 GPUs
    deepspeed --num_gpus 8 tutorials/scripts/hello_ranks.py               # same, DeepSpeed's launcher

The launcher sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the script picks
nccl where GPUs exist and gloo otherwise. Rank 0 prints one JSON line with the result: how far
apart the ranks' parameters are (``param_spread``) and how far from one process that trained on
every rank's data (``reference_error``, :func:`gas_lab.measure.parity.reference_params`).
"""

import argparse
import json

import torch
import torch.distributed as dist
from shm_buffers import remove_own_buffer

from gas_lab.dp import end_rank, init_from_env
from gas_lab.lessons import hello
from gas_lab.measure.parity import reference_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to train")
    parser.add_argument("--local_rank", type=int, default=None, help="set by `deepspeed`; unused")
    args = parser.parse_args()

    backend = init_from_env()
    greeting = hello.all_reduce_hello()
    result = hello.train_tiny_deepspeed(steps=args.steps)

    # Equal parameters on every rank say the replicas agree, no more: at ZeRO stage 1, step()
    # ends by all-gathering every rank's updated slice, so the ranks agree even on wrong weights.
    # The proof that the gradients were averaged is the one-process reference.
    params = result["params"].cuda() if backend == "nccl" else result["params"]
    others = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(others, params)
    spread = max((p - params).abs().max().item() for p in others)
    if dist.get_rank() == 0:
        reference = reference_params(
            hello.zero1_config(), args.steps, world_size=dist.get_world_size(), clip=1.0
        )
        summary = {k: result[k] for k in ("global_steps", "global_samples", "micro_steps")}
        print(
            json.dumps(
                {
                    "backend": backend,
                    "world_size": dist.get_world_size(),
                    "all_reduce": greeting["received"],
                    "param_spread": spread,
                    "reference_error": (result["params"] - reference).abs().max().item(),
                    "params_sum": result["params"].sum().item(),
                    **summary,
                }
            )
        )
    remove_own_buffer(dist.get_rank())  # what DeepSpeed's CPU op left in /dev/shm (`deepspeed`)
    end_rank()  # skips a teardown that sometimes aborts after the work is done


if __name__ == "__main__":
    main()
