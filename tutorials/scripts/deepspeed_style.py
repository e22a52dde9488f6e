"""A training script written the way DeepSpeed's examples are, run on DeepSpeed or on gas_lab.

Nothing in the loop knows which library it runs on: the config comes from ``--deepspeed_config``
(``deepspeed.add_config_arguments``), the engine says where the data goes
(``model_engine.device``, ``model_engine.local_rank``), ``deepspeed.comm`` sums the losses for
the log, and ``--engine`` picks whose ``initialize`` builds the engine, the one line that
differs::

    torchrun --standalone --nproc_per_node 2 tutorials/scripts/deepspeed_style.py \\
        --deepspeed --deepspeed_config tutorials/scripts/ds_config.json          # DeepSpeed
    torchrun --standalone --nproc_per_node 2 tutorials/scripts/deepspeed_style.py \\
        --deepspeed --deepspeed_config tutorials/scripts/ds_config.json --engine gas_lab
    deepspeed --num_gpus 8 tutorials/scripts/deepspeed_style.py --deepspeed_config my.json

The task is a small classifier on synthetic data (every rank builds the same dataset; the
engine's loader gives each rank its share). Managed (DeepSpeed's default), ``step()`` follows
every micro-batch; unmanaged (``"managed_gradient_accumulation": false`` in the config), a step
takes 1, 3, 2, 1, 3, 2, ... micro-batches, each loss divided by that number, with
``scale_wrt_gas=False``. Rank 0 prints one JSON line per optimizer step (the loss averaged over
the step's micro-batches and the ranks) and a summary line.
"""

import argparse
import json
import os

import deepspeed
import torch
from deepspeed import comm

WINDOWS = (1, 3, 2)  # unmanaged: micro-batches per step, cycled


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=("deepspeed", "gas_lab"), default="deepspeed",
                        help="whose initialize() builds the engine")  # fmt: skip
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    return parser.parse_args(argv)


def dataset(seed: int, n: int = 96, classes: int = 4) -> torch.utils.data.TensorDataset:
    """Inputs of 3x8x8 "images" whose class is the brightest of four quadrants, plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 8, 8, generator=g)
    quadrants = x.mean(1).unfold(1, 4, 4).unfold(2, 4, 4).mean((-1, -2)).reshape(n, classes)
    return torch.utils.data.TensorDataset(x, quadrants.argmax(1))


def model(seed: int, classes: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(6 * 4 * 4, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, classes),
    )  # fmt: skip


def windows(loader, managed: bool, gas: int):
    """The micro-batches of each optimizer step: GAS of them managed, 1, 3, 2, ... unmanaged."""
    batches, out, k = list(loader), [], 0
    while batches:
        size = gas if managed else WINDOWS[k % len(WINDOWS)]
        out.append(batches[:size])
        batches, k = batches[size:], k + 1
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.engine == "gas_lab":
        from gas_lab import initialize
    else:
        from deepspeed import initialize
    net = model(args.seed)
    model_engine, optimizer, trainloader, _ = initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=dataset(args.seed)
    )
    assert args.local_rank == model_engine.local_rank  # set by initialize, as DeepSpeed does
    rank, world = comm.get_rank(), comm.get_world_size()
    criterion = torch.nn.CrossEntropyLoss()
    managed = model_engine.managed_gradient_accumulation()
    log = []
    for epoch in range(args.epochs):
        for step in windows(trainloader, managed, model_engine.gradient_accumulation_steps()):
            step_loss = torch.zeros((), device=model_engine.device)
            for inputs, labels in step:
                inputs, labels = inputs.to(model_engine.device), labels.to(model_engine.device)
                if model_engine.bfloat16_enabled():
                    inputs = inputs.bfloat16()
                loss = criterion(model_engine(inputs), labels)
                if managed:
                    model_engine.backward(loss)
                    model_engine.step()
                else:
                    model_engine.backward(loss / len(step), scale_wrt_gas=False)
                step_loss += loss.detach().float() / len(step)
            if not managed:
                model_engine.step()
            comm.all_reduce(step_loss)  # the step's loss, averaged over the ranks
            norm = model_engine.get_global_grad_norm()
            record = {
                "epoch": epoch,
                "loss": step_loss.item() / world,
                "global_steps": model_engine.global_steps,
                "global_samples": model_engine.global_samples,
                "grad_norm": None if norm is None else float(norm),
            }
            log.append(record)
            if rank == 0:
                print(json.dumps(record), flush=True)
    params = torch.cat([p.detach().float().flatten() for p in model_engine.module.parameters()])
    if rank == 0:
        print(json.dumps({"summary": True, "engine": args.engine, "world_size": world,
                          "stage": model_engine.zero_optimization_stage(), "managed": managed,
                          "steps": len(log), "params_sum": params.sum().item()}), flush=True)  # fmt: skip
    return log


if __name__ == "__main__":
    from shm_buffers import remove_own_buffer  # beside this file; imported only when run

    main()
    remove_own_buffer(comm.get_rank())  # what DeepSpeed's CPU op left in /dev/shm (`deepspeed`)
    # The interpreter's teardown sometimes aborts after the work is done (gas_lab.dp.end_rank
    # says why); leave at once, status 0.
    comm.destroy_process_group()
    os._exit(0)
