"""Malformed configs for ``gas_lab.initialize``, generated from a seed (tests/test_config_fuzz.py).

Each case takes a working config and puts one bad value at one key gas_lab reads (or an unknown
key inside a section); ``outcome(case)`` runs ``gas_lab.initialize`` on one process and one
training step, and sorts what happened:

* ``"clear"``: a gas_lab error (ConfigError, RejectedCombination, NotImplementedInGasLab) whose
  message names the key;
* ``"unclear"``: any other exception, or a gas_lab error that does not name the key;
* ``"accepted"``: initialize and one step ran.

``python tests/config_fuzz.py`` prints the counts (for the before/after of issue 14, part 6);
``--deepspeed`` also runs every accepted case on DeepSpeed (one process, one step) and lists
those DeepSpeed refuses or crashes on (a few minutes: one ``deepspeed.initialize`` each).
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

import torch

BASES = {
    "adam": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    },
    "adam-torch-zero1": {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    },
    "sgd": {
        "train_batch_size": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    },
}
BAD_VALUES = (None, -1, 0, 3, 2.5, -0.5, 1e30, math.nan, math.inf, "2", "auto", "yes", True,
              False, [], {}, [0.9, 1.5], {"foo_unknown": 1})  # fmt: skip
TOP = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
       "managed_gradient_accumulation", "gradient_clipping", "zero_allow_untested_optimizer",
       "steps_per_print", "wall_clock_breakdown", "prescale_gradients",
       "gradient_predivide_factor", "gradient_allreduce_op", "communication_data_type",
       "dataloader_drop_last", "amp", "fp16", "bf16", "compile", "zero_optimization", "optimizer",
       "data_types", "scheduler")  # fmt: skip
ZERO = ("stage", "reduce_bucket_size", "reduce_scatter", "use_multi_rank_bucket_allreduce",
        "contiguous_gradients", "compute_grad_norm", "overlap_comm", "allgather_bucket_size",
        "allgather_partitions", "round_robin_gradients", "offload_optimizer", "offload_param")  # fmt: skip
SECTIONS = (("fp16", "enabled"), ("fp16", "loss_scale"), ("bf16", "enabled"),
            ("bf16", "immediate_grad_update"), ("compile", "deepcompile"),
            ("data_types", "grad_accum_dtype"), ("optimizer", "type"), ("optimizer", "params"),
            ("zero_optimization", "offload_optimizer", "device"),
            ("zero_optimization", "offload_param", "device"))  # fmt: skip
ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "adam_w_mode",
               "max_grad_norm", "bias_correction", "foreach")  # fmt: skip
SGD_PARAMS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
UNKNOWN_AT = ((), ("zero_optimization",), ("fp16",), ("bf16",), ("compile",),
              ("zero_optimization", "offload_optimizer"), ("zero_optimization", "offload_param"),
              ("optimizer",), ("optimizer", "params"), ("data_types",))  # fmt: skip


@dataclass(frozen=True)
class Case:
    base: str
    path: tuple[str, ...]  # where the value goes
    value: object

    @property
    def key(self) -> str:
        return ".".join(self.path)

    def config(self) -> dict:
        config = copy.deepcopy(BASES[self.base])
        node = config
        for part in self.path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[self.path[-1]] = copy.deepcopy(self.value)
        return config


def all_cases() -> list[Case]:
    """Every (base, key, bad value) and every unknown key: the population the seed samples."""
    cases = []
    for base in BASES:
        params = SGD_PARAMS if base == "sgd" else ADAM_PARAMS
        paths = [(k,) for k in TOP] + [("zero_optimization", k) for k in ZERO]
        paths += list(SECTIONS) + [("optimizer", "params", p) for p in params]
        cases += [Case(base, path, value) for path in paths for value in BAD_VALUES]
        cases += [Case(base, (*where, "foo_unknown"), 1) for where in UNKNOWN_AT]
    return cases


def sample(seed: int = 0, n: int = 600) -> list[Case]:
    cases = all_cases()
    return random.Random(seed).sample(cases, min(n, len(cases)))


def outcome(case: Case) -> tuple[str, str]:
    """("clear" | "unclear" | "accepted", the error message or "")."""
    import gas_lab
    from gas_lab.errors import GasLabError

    try:
        _one_step(gas_lab.initialize, case.config())
    except Exception as err:  # the point: sort whatever is raised
        message = f"{type(err).__name__}: {err}"
        names_key = case.path[-1] in str(err) or (
            case.path[-1] == "foo_unknown" and "foo_unknown" in str(err)
        )
        clear = isinstance(err, GasLabError) and names_key
        return ("clear" if clear else "unclear"), message
    return "accepted", ""


def _one_step(initialize, config: dict) -> None:
    """initialize, then one optimizer step (GAS micro-batches) on the tiny model."""
    from gas_lab.toys import micro_batch, tiny_model

    model = tiny_model(0)
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    for micro in range(engine.gradient_accumulation_steps()):
        x, y = micro_batch(0, 0, micro, 0, engine.train_micro_batch_size_per_gpu())
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def deepspeed_outcome(case: Case) -> str:
    """ "accepted" or the exception DeepSpeed 0.19.8 raises, in initialize or the first step."""
    from gas_lab.measure.parity import deepspeed_initialize

    try:
        _one_step(deepspeed_initialize(), case.config())
    except Exception as err:  # the point: sort whatever is raised
        return f"{type(err).__name__}: {str(err)[:120]}"
    return "accepted"


def run(seed: int = 0, n: int = 600) -> dict[str, list]:
    out: dict[str, list] = {"clear": [], "unclear": [], "accepted": []}
    for case in sample(seed, n):
        kind, message = outcome(case)
        out[kind].append((case, message))
    return out


if __name__ == "__main__":
    import os
    import sys
    import warnings

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.simplefilter("ignore")
    result = run()
    print({k: len(v) for k, v in result.items()})
    for case, message in result["unclear"]:
        print(f"UNCLEAR {case.base:17} {case.key}={case.value!r}: {message[:150]}")
    if "--deepspeed" in sys.argv:
        refused = [(c, deepspeed_outcome(c)) for c, _ in result["accepted"]]
        refused = [(c, m) for c, m in refused if m != "accepted"]
        print(f"accepted by gas_lab, refused or crashed by DeepSpeed: {len(refused)}")
        for case, message in refused:
            print(f"  {case.base:17} {case.key}={case.value!r}: {message}")
