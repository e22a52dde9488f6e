"""Measure which combinations DeepSpeed accepts and rejects, and when, on 2 CPU ranks.

    .venv/bin/python -m gas_lab.measure.matrix     # writes data/deepspeed_<version>_matrix.json

Every case is a config plus a small script of operations ("ops") run after ``initialize``,
each named once in :mod:`gas_lab.rules.operations`: ``backward`` (forward + ``engine.backward(loss)``),
``tensor_backward`` (forward + ``loss.backward()``), ``step``,
``set_boundary_true``/``set_boundary_false``, ``enter_no_sync``/``exit_no_sync``,
``enter_coalesce``/``exit_coalesce`` and ``train_batch`` (pipelines). For each case the file records: accepted or rejected, the exception type and
message, the op that raised and its moment (``initialize``, ``call`` or ``context``: entering a
with-block), and for accepted cases what DeepSpeed actually built (the optimizer class, the
effective ``managed_gradient_accumulation``) and its counters at the end.

The same :func:`run_case` runs a case on gas_lab (``tests/test_rules.py``), so both libraries
are driven by the same ops. ``tests/test_matrix.py`` re-measures a subset against the installed
DeepSpeed, so an upgrade that changes the matrix fails loudly.
"""

from __future__ import annotations

import copy
import itertools
import json
import platform
import sys
import time
from pathlib import Path

from gas_lab.rules import operations

DATA = Path(__file__).resolve().parents[2] / "data"  # the repository's data/ folder
GAS = 2  # gradient_accumulation_steps of every case
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": GAS,
    # torch's Adam: ZeRO vouches for it, and it needs no JIT build (not even with CPU offload).
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    "steps_per_print": 10**9,  # keep the logs quiet
}
TRAIN = {  # one optimizer step; unmanaged runs 3 micro-batches on purpose (N != GAS is allowed)
    True: ["backward", "step", "backward", "step"],
    False: ["backward", "backward", "backward", "step"],
}
NOTES = [  # choices made when measuring, written into the file
    "Adam with torch_adam: true everywhere. With offload_optimizer device cpu DeepSpeed then "
    "wraps torch.optim.AdamW, so no cpu_adam JIT build (minutes) is needed; DeepSpeedCPUAdam "
    "itself is not exercised.",
    "fp16 is refused at initialize because the CPU reports no fp16 support: a device check, "
    "accepted on devices with fp16. DeepSpeed's CPU accelerator asks oneDNN, which says yes on "
    "CPUs with AVX512-FP16, so measure() pins the answer to no on every machine.",
    "bf16 engines get their inputs cast to bf16.",
    "DeepCompile: engine.compile() is never called, so accepted cases run without it active.",
    "Pipelines: PipelineModule(num_stages=1) on 2 ranks (2-way data parallel), train_batch().",
    "Uneven numbers of backward() calls across ranks are not in the matrix: at ZeRO-2/3 they "
    "hang or kill a rank (lessons 06 and 09 show it with a timeout; tests/test_stages.py).",
]


def _case(group, config, ops, pipeline=False, **axes):
    name = "/".join(f"{k}={v}" for k, v in axes.items())
    return {
        "id": f"{group}/{name}",
        "group": group,
        "axes": axes,
        "config": config,
        "ops": ops,
        "pipeline": pipeline,
    }


def _config(stage=0, managed=True, **extra):
    zero = {"stage": stage, **extra.pop("zero", {})}
    return {**BASE, "managed_gradient_accumulation": managed, "zero_optimization": zero, **extra}


def cases() -> list[dict]:
    """Every combination measured, grouped; ids are stable so tests can pick some."""
    out = []
    # 1. The grid: stage x managed x overlap_comm x optimizer offload x precision, then train.
    precisions = {
        "fp32": {},
        "bf16": {"bf16": {"enabled": True}},
        "fp16": {"fp16": {"enabled": True}},
    }
    for stage, managed, overlap, offload, precision in itertools.product(
        range(4), (True, False), (False, True), ("none", "cpu"), precisions
    ):
        zero = {"overlap_comm": overlap}
        if offload != "none":
            zero["offload_optimizer"] = {"device": offload}
        config = _config(stage, managed, zero=zero, **precisions[precision])
        out.append(
            _case(
                "grid",
                config,
                TRAIN[managed],
                stage=stage,
                managed=managed,
                overlap_comm=overlap,
                offload=offload,
                precision=precision,
            )
        )
    # 2. Calls and contexts that move or suspend the boundary, at every stage, both modes.
    scripts = {
        "set_boundary_true": lambda m: ["set_boundary_true", *TRAIN[m]],
        "set_boundary_false": lambda m: ["set_boundary_false", *TRAIN[m]],
        "no_sync": lambda m: ["enter_no_sync", "backward", "exit_no_sync", *TRAIN[m][1:]],
        "step_in_no_sync": lambda m: ["enter_no_sync", "backward", "step"],
        "no_sync_reentry": lambda m: ["enter_no_sync", "enter_no_sync"],
        "coalesce": lambda m: (
            ["enter_coalesce", "backward", "backward", "exit_coalesce"]
            + ["step"] * (GAS if m else 1)
        ),
        "tensor_backward": lambda m: [op.replace("backward", "tensor_backward") for op in TRAIN[m]],
    }
    for (name, script), stage, managed in itertools.product(
        scripts.items(), range(4), (True, False)
    ):
        out.append(
            _case(
                "api",
                _config(stage, managed),
                script(managed),
                stage=stage,
                managed=managed,
                api=name,
            )
        )
    # 3. Features with their own engine or config block.
    for managed in (True, False):
        for stage in (0, 1):
            out.append(
                _case(
                    "pipeline",
                    _config(stage, managed),
                    ["train_batch"],
                    pipeline=True,
                    stage=stage,
                    managed=managed,
                )
            )
            deepcompile = _config(stage, managed, compile={"deepcompile": True})
            out.append(
                _case("deepcompile", deepcompile, TRAIN[managed], stage=stage, managed=managed)
            )
        for enabled in (True, False):
            out.append(
                _case(
                    "amp",
                    _config(0, managed, amp={"enabled": enabled}),
                    TRAIN[managed],
                    managed=managed,
                    enabled=enabled,
                )
            )
    # 4. Lesson 08: "gradient_allreduce_op": "sum" at every stage (and with DeepCompile), and
    # bf16 x data_types.grad_accum_dtype at stages 0 and 1.
    for stage, managed in itertools.product(range(4), (True, False)):
        out.append(
            _case(
                "edges",
                _config(stage, managed, gradient_allreduce_op="sum"),
                TRAIN[managed],
                stage=stage,
                managed=managed,
                op="sum",
            )
        )
    for stage in (0, 1):
        sum_compile = _config(stage, gradient_allreduce_op="sum", compile={"deepcompile": True})
        out.append(_case("edges", sum_compile, TRAIN[True], stage=stage, op="sum_deepcompile"))
    for stage, managed, bf16, accum in itertools.product(
        (0, 1), (True, False), (False, True), ("fp32", "bf16")
    ):
        extra = {"data_types": {"grad_accum_dtype": accum}}
        if bf16:
            extra["bf16"] = {"enabled": True}
        out.append(
            _case(
                "edges",
                _config(stage, managed, **extra),
                TRAIN[managed],
                stage=stage,
                managed=managed,
                bf16=bf16,
                grad_accum_dtype=accum,
            )
        )
    # Where the mean divides (lessons 05 and 08): prescale_gradients at stages 0-2 and, at
    # stage 2, gradient_predivide_factor, with and without the keys ZeRO-2 checks them under.
    rs_false = {"zero": {"reduce_scatter": False}}
    division = {
        "prescale": {"prescale_gradients": True},
        "predivide": {"gradient_predivide_factor": 2.0},
        "prescale_predivide": {"prescale_gradients": True, "gradient_predivide_factor": 2.0},
        "prescale_sum": {"prescale_gradients": True, "gradient_allreduce_op": "sum"},
        "prescale_reduce_scatter_false": {"prescale_gradients": True, **rs_false},
    }
    for stage, (name, extra) in [
        (0, ("prescale", division["prescale"])),
        (1, ("prescale", division["prescale"])),
        *((2, item) for item in division.items()),
    ]:
        out.append(
            _case(
                "edges",
                _config(stage, **copy.deepcopy(extra)),
                TRAIN[True],
                stage=stage,
                division=name,
            )
        )
    # 5. Lesson 09: ZeRO-2's reduction variants, managed and unmanaged (gas_lab implements the
    # default reduction, with any bucket size, and leaves the others to DeepSpeed).
    variants = {
        "small_buckets": {"reduce_bucket_size": 20},
        "reduce_scatter_false": {"reduce_scatter": False},
        "contiguous_gradients_false": {"contiguous_gradients": False},
        "round_robin_gradients": {"round_robin_gradients": True},
    }
    for (variant, zero), managed in itertools.product(variants.items(), (True, False)):
        out.append(
            _case(
                "zero2",
                _config(2, managed, zero=zero),
                TRAIN[managed],
                stage=2,
                managed=managed,
                variant=variant,
            )
        )
    # 6. Config checks that have nothing to do with the boundary, and DeepSpeed's leniency.
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    for stage in (0, 1):
        out.append(
            _case(
                "config",
                _config(stage, optimizer=sgd),
                TRAIN[True],
                stage=stage,
                check="sgd_untested",
            )
        )
    clip = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "max_grad_norm": 1.0}}
    out.append(_case("config", _config(0, optimizer=clip), TRAIN[True], check="max_grad_norm"))
    lenient = {"managed_string_no": {"managed_gradient_accumulation": "no"},
               "managed_typo": {"managed_gradient_acumulation": False}}  # fmt: skip
    for check, extra in lenient.items():
        config = {k: v for k, v in _config(0).items() if k != "managed_gradient_accumulation"}
        out.append(_case("config", {**config, **extra}, TRAIN[True], check=check))
    return out


# ------------------------------------------------------------------------------- running a case
def run_case(initialize, case: dict, model_fn=operations.model) -> dict:
    """Run one case with ``initialize`` (DeepSpeed's or gas_lab's) on this rank.

    ``model_fn(pipeline)`` builds the model (tests swap in a stand-in PipelineModule).
    """
    script, op = operations.Script(), "initialize"
    try:
        model = model_fn(case["pipeline"])
        engine, *_ = initialize(
            model=model,
            model_parameters=model.parameters(),
            config=json.loads(json.dumps(case["config"])),
        )
        for op in case["ops"]:
            operations.perform(engine, [op], script)
    except Exception as err:  # the point: record whatever is raised, wherever
        return {
            "outcome": "rejected",
            "exception": type(err).__name__,
            "is_a": _exception_types(err),
            "message": str(err).strip(),
            "raised_in": op,
            "moment": operations.call_of(op).moment,
        }
    optimizer = getattr(engine, "optimizer", None)
    return {
        "outcome": "accepted",
        "exception": None,
        "message": None,
        "raised_in": None,
        "moment": None,
        "observed": {
            "managed": bool(engine.managed_gradient_accumulation()),
            "optimizer": type(optimizer).__name__,
            "counters": [engine.global_steps, engine.global_samples, engine.micro_steps],
        },
    }


def _exception_types(err: BaseException) -> list[str]:
    """The names ``err`` can be caught by, itself first (gas_lab's RejectedCombination is also
    the type DeepSpeed raises for the rule)."""
    return [c.__name__ for c in type(err).__mro__ if c not in (BaseException, Exception, object)]


def measure(selected: list[dict], engine: str = "deepspeed") -> list[dict]:
    """On a rank: run every case with DeepSpeed (or gas_lab), as on a CPU without fp16 kernels;
    quiet DeepSpeed's logging."""
    import logging

    from gas_lab.deepspeed_compat.engine import initialize as gas_initialize
    from gas_lab.measure.loss_scale import fp16_support
    from gas_lab.measure.parity import deepspeed_initialize

    init = deepspeed_initialize() if engine == "deepspeed" else gas_initialize
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    with fp16_support(False):  # the same matrix on a CPU with fp16 kernels (see NOTES)
        return [run_case(init, case) for case in selected]


def main(out: Path | None = None) -> Path:
    import deepspeed
    import torch

    from gas_lab.runtime.cluster import start_cluster, stop_cluster

    all_cases = cases()
    t0 = time.perf_counter()
    cluster = start_cluster(world_size=2, device="cpu")  # the matrix is a CPU one
    try:
        per_rank = cluster.run(measure, all_cases, timeout=600)
    finally:
        stop_cluster()
    for case, *results in zip(all_cases, *per_rank, strict=True):
        if any(r != results[0] for r in results):  # would mean a rank-dependent rule
            raise RuntimeError(f"ranks disagree on {case['id']}: {results}")
        case.update(results[0])
    out = out or DATA / f"deepspeed_{deepspeed.__version__}_matrix.json"
    accepted = sum(c["outcome"] == "accepted" for c in all_cases)
    doc = {
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "accelerator": "cpu (DS_ACCELERATOR=cpu), gloo, 2 ranks",
        "measured_by": "python -m gas_lab.measure.matrix",
        "notes": NOTES,
        "summary": {
            "cases": len(all_cases),
            "accepted": accepted,
            "rejected": len(all_cases) - accepted,
        },  # fmt: skip
        "cases": "CASES",
    }
    out.parent.mkdir(exist_ok=True)
    # One case per line: small, and a re-measurement diffs line by line.
    rows = ",\n  ".join(json.dumps(c) for c in all_cases)
    text = json.dumps(doc, indent=1).replace('"cases": "CASES"', f'"cases": [\n  {rows}\n ]')
    out.write_text(text + "\n")
    print(
        f"{len(all_cases)} cases ({accepted} accepted) in {time.perf_counter() - t0:.0f} s -> {out}"
    )
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
