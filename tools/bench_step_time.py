"""Time per optimizer step: gas_lab vs DeepSpeed vs plain PyTorch DDP, on the same loop.

Run it on 2 CPU processes (or one process per GPU)::

    torchrun --standalone --nproc_per_node 2 tools/bench_step_time.py
    torchrun --standalone --nproc_per_node 2 tools/bench_step_time.py --hidden 1024 --gas 8

All three train the same MLP from the same seed on the same data (drawn per step, micro-batch
and rank), managed accumulation with ZeRO stage 0, the same optimizer and no clipping:

* gas_lab and DeepSpeed: ``engine(x)``, ``engine.backward(loss)``, ``engine.step()`` on every
  micro-batch (the symmetric loop of lesson 03);
* DDP: ``no_sync()`` around forward and backward of all but the last micro-batch, ``loss / GAS``,
  one ``optimizer.step()`` (lesson 02).

The libraries take turns for ``--rounds`` rounds of ``--steps`` timed optimizer steps each (so
a burst of load on a shared machine hits all three); a round's time is the slowest rank's. The
median round gives ms per step. Rank 0 prints one line per library, the ratios, the largest
parameter difference between the three runs (a check that they ran the same loop) and a JSON
line. Timings on a shared or busy machine are noisy: compare ratios from one run, not numbers
across runs. From a notebook, ``cluster.run(module.bench, ...)`` runs :func:`bench` on the ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.distributed as dist

LIBRARIES = ("gas_lab", "deepspeed", "ddp")


def make_model(d_in: int, hidden: int, layers: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # same seed on every rank and for every library
    sizes = [d_in] + [hidden] * layers
    blocks = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        blocks += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(sizes[-1], 1))


def batch(step: int, micro: int, rank: int, size: int, d_in: int, device) -> tuple:
    g = torch.Generator().manual_seed((step * 1000 + micro) * 1000 + rank)
    x = torch.randn(size, d_in, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).tanh().to(device)


class Runner:
    """One library's model and loop; ``run(first, steps)`` trains optimizer steps in order."""

    def __init__(self, library: str, config: dict, args, device):
        from gas_lab.deepspeed_compat.config import load_config

        self.library, self.args, self.device = library, args, device
        self.gas = config["gradient_accumulation_steps"]
        self.rank = dist.get_rank()
        model = make_model(args.d_in, args.hidden, args.layers)
        if library == "deepspeed":
            from gas_lab.measure.parity import deepspeed_initialize

            self.engine = deepspeed_initialize()(
                model=model, model_parameters=model.parameters(), config=config
            )[0]
        elif library == "gas_lab":
            from gas_lab.deepspeed_compat.engine import initialize

            model.to(device)
            self.engine = initialize(
                model=model, model_parameters=model.parameters(), config=config
            )[0]
        else:
            model.to(device)
            ids = [device.index] if device.type == "cuda" else None
            self.engine = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            optimizer_config = load_config(config, dist.get_world_size()).optimizer
            self.optimizer = optimizer_config.torch_optimizer(model.parameters())
        self.module = model

    def run(self, first: int, steps: int) -> None:
        mse = torch.nn.functional.mse_loss
        a = self.args
        for step in range(first, first + steps):
            for m in range(self.gas):
                x, y = batch(step, m, self.rank, a.micro, a.d_in, self.device)
                if self.library == "ddp":
                    last = m == self.gas - 1
                    with contextlib.nullcontext() if last else self.engine.no_sync():
                        (mse(self.engine(x), y) / self.gas).backward()
                else:
                    self.engine.backward(mse(self.engine(x), y))
                    self.engine.step()
            if self.library == "ddp":
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().float().cpu().flatten() for p in self.module.parameters()])


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return t.item()


def bench(args) -> dict:
    """Run on every rank (process group initialized); returns ms per step and checks."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; DDP would need its own clip
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    runners = {lib: Runner(lib, config, args, device) for lib in LIBRARIES}
    for runner in runners.values():
        runner.run(0, args.warmup)  # first steps allocate buffers and warm caches
    rounds: dict[str, list[float]] = {lib: [] for lib in LIBRARIES}
    for r in range(args.rounds):
        first = args.warmup + r * args.steps
        for lib, runner in runners.items():
            dist.barrier()
            t0 = time.perf_counter()
            runner.run(first, args.steps)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rounds[lib].append(_slowest(time.perf_counter() - t0) / args.steps)
    ms = {lib: 1000 * statistics.median(times) for lib, times in rounds.items()}
    params = {lib: runner.params() for lib, runner in runners.items()}
    diff = max((params[lib] - params["ddp"]).abs().max().item() for lib in LIBRARIES)
    n_params = sum(p.numel() for p in runners["ddp"].module.parameters())
    return {"ms_per_step": ms, "max_param_diff": diff, "parameters": n_params}


def report(result: dict, args) -> str:
    ms = result["ms_per_step"]
    lines = [
        f"{dist.get_world_size()} ranks ({dist.get_backend()}), MLP {result['parameters']:,} "
        f"parameters, micro {args.micro} x GAS {args.gas}, {args.rounds} rounds x "
        f"{args.steps} steps (median round)",
    ]
    lines += [f"{lib:10s} {ms[lib]:9.2f} ms per optimizer step" for lib in LIBRARIES]
    lines.append(
        f"ratios     gas_lab/ddp {ms['gas_lab'] / ms['ddp']:.2f}   "
        f"deepspeed/ddp {ms['deepspeed'] / ms['ddp']:.2f}   "
        f"gas_lab/deepspeed {ms['gas_lab'] / ms['deepspeed']:.2f}"
    )
    lines.append(
        f"same loop: max |parameter difference| between the three = {result['max_param_diff']:.1e}"
    )
    lines.append(json.dumps({**result, "args": vars(args)}))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--gas", type=int, default=4)
    parser.add_argument("--micro", type=int, default=16, help="samples per micro-batch")
    parser.add_argument("--d-in", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)

    from gas_lab.dp import init_from_env

    init_from_env()  # from torchrun's RANK/WORLD_SIZE/MASTER_*
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    result = bench(args)
    if dist.get_rank() == 0:
        print(report(result, args), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
