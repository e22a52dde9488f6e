"""Check your own loop: does one optimizer step of it equal the objective you declare?

``python -m gas_lab.check FILE.py:FUNCTION`` (in a notebook, :func:`check_loop`) runs your
function on 2 CPU ranks (gloo; no launcher needed) at each ZeRO stage asked, on cases chosen to
separate the known normalization mistakes, and compares the weights it ends with against one
process computing the declared objective over the whole step.

**The contract.** ``FUNCTION(engine, micro_batches)`` runs *one optimizer step on one rank* in
unmanaged mode (``"managed_gradient_accumulation": false``): ``engine.backward(loss)`` for each
micro-batch, then ``engine.step()`` once. It may use ``torch.distributed`` (the process group
is initialized). ``micro_batches`` is that rank's list, possibly empty, of dicts in Hugging
Face's convention::

    {"input_ids": LongTensor[B, T],
     "labels": LongTensor[B, T],          # -100: no target here
     "attention_mask": LongTensor[B, T]}

``engine(input_ids)`` returns the logits ``[B, T, V]`` of a small language model the checker
builds; ``labels[b, t]`` is the target of ``logits[b, t]`` (no shift). The engine averages the
ranks' gradients, as DeepSpeed does. The config is the checker's (SGD, lr 1, one micro-batch
per engine step, no clipping, the stage under test), or yours (``config=``), with only the ZeRO
stage and unmanaged accumulation set; the reference then uses your optimizer and clipping.

**The objectives** (``reduction``): ``token``, the mean cross-entropy over every label that is
not -100 in the whole step (every rank, every micro-batch); ``sequence``, the mean over sequences
of each sequence's own token mean; ``sum``, the total; ``token-sum/sequences``, the total divided
by the number of sequences. ``constant=C`` divides any of them by C. A sequence with no label
left is not a sequence unless ``count_empty_sequences=True``.

**The verdict** per stage and case: PASS when every parameter agrees with the reference to a
relative 1e-5; otherwise the case, the error, and a diagnosis computed by replaying the known
wrong normalizations (:mod:`~gas_lab.check.diagnosis`). ``equal_counts=True`` runs only the
cases where every rank has the same number of micro-batches (for trainers that guarantee it).
"""

from __future__ import annotations

import time
from dataclasses import replace

from tqdm.auto import tqdm

from gas_lab.check import diagnosis
from gas_lab.check.cases import BY_NAME, WORLD_SIZE, chosen
from gas_lab.check.objectives import REDUCTIONS, objective
from gas_lab.check.report import PASS, CaseResult, CheckResult
from gas_lab.check.trial import RTOL, agrees, config_for, relative_error, trial
from gas_lab.runtime.cluster import start_cluster
from gas_lab.runtime.rank_errors import RankError, RankStallError

CASE_TIMEOUT_S = 20.0  # a case takes about a second; a rank that waits longer than this stalled
LIBRARIES = ("deepspeed", "gas_lab")


def check_arguments(reduction, stages, library, constant, config) -> tuple[int, ...]:
    """Raise ValueError naming the argument that is wrong; return the stages as a tuple."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r}: choose from {', '.join(REDUCTIONS)}")
    if library not in LIBRARIES:
        raise ValueError(f"library {library!r}: choose from {', '.join(LIBRARIES)}")
    stages = tuple(stages)
    top = 3 if library == "deepspeed" else 2
    if not stages or any(not isinstance(s, int) or not 0 <= s <= top for s in stages):
        raise ValueError(
            f"stages {list(stages)}: each a ZeRO stage from 0 to {top}"
            + (" (gas_lab builds stages 0-2)" if library == "gas_lab" else "")
        )
    if constant is not None and not constant > 0:
        raise ValueError(f"constant {constant!r}: a number > 0")
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"config: a DeepSpeed config dict, got {type(config).__name__}")
    return stages


def _import(library: str) -> None:
    """On every rank: the slow imports (and DeepSpeed's first C++ build) before any case."""
    from gas_lab.measure.parity import initializer

    initializer(library)


def check_loop(
    fn,
    reduction: str = "token",
    stages=(0, 1, 2),
    *,
    constant: float | None = None,
    count_empty_sequences: bool = False,
    equal_counts: bool = False,
    library: str = "deepspeed",
    config: dict | None = None,
    cluster=None,
    progress: bool = True,
) -> CheckResult:
    """Check ``fn(engine, micro_batches)`` (the contract: this module's docstring) on the
    notebook's ranks (``cluster``, or 2 CPU ranks started for it); returns a
    :class:`~gas_lab.check.report.CheckResult`, which a notebook shows as a table."""
    stages = check_arguments(reduction, stages, library, constant, config)
    t0 = time.perf_counter()
    cluster = cluster or start_cluster(world_size=WORLD_SIZE, device="cpu")
    if cluster.world_size != WORLD_SIZE:
        raise ValueError(f"cluster: the checker's cases are for {WORLD_SIZE} ranks")
    cfg = config_for(0, config)
    gas = int(cfg.get("gradient_accumulation_steps") or 1)
    right = objective(reduction, constant or 1.0, count_empty_sequences)
    if str(cfg.get("gradient_allreduce_op", "mean")).lower() == "sum":
        right = replace(right, times_world=False)  # the engine sums the ranks' gradients
    cluster.run(_import, library, timeout=600)
    results = []
    todo = [(s, c) for s in stages for c in chosen(equal_counts)]
    bar = tqdm(total=len(todo), unit="case", leave=False, disable=not progress)
    for stage, case in todo:
        bar.set_description(f"stage {stage}, {case.name}")
        try:
            got = cluster.run(trial, fn, case.name, stage, library, config, timeout=CASE_TIMEOUT_S)
            reference = diagnosis.replayed(case, right, config)  # the same at every stage
            results.append(_judge(stage, case, got, reference, right, config, gas))
        except (RankError, RankStallError) as err:
            results.append(_failed(stage, case, err))
        bar.update()
    bar.close()
    _keep_what_every_case_says(results)
    return CheckResult(reduction, library, list(stages), results, time.perf_counter() - t0)


def _keep_what_every_case_says(results: list[CaseResult]) -> None:
    """Where one case fits several known mistakes (an idle rank's own token count is every
    rank's), keep those that fit every wrong case of the stage: the loop made one mistake."""
    for stage in {r.stage for r in results}:
        wrong = [r for r in results if r.stage == stage and r.outcome == "wrong weights"]
        common = set.intersection(*(set(r.diagnosis) for r in wrong)) if wrong else set()
        common.discard(diagnosis.NONE_KNOWN)
        for r in wrong if common else []:
            r.diagnosis = [d for d in r.diagnosis if d in common]


def _failed(stage, case, err) -> CaseResult:
    """A case the ranks did not finish: the loop or the engine raised, a rank died, or a hang
    (``RankStallError``); its traceback first, then what that means at this stage."""
    detail = "\n".join(err._render_traceback_())
    if isinstance(err, RankStallError):
        return CaseResult(
            stage, case.name, "hang", None, [diagnosis.crash(case, stage, True)], detail
        )
    by_loop = (
        bool(err.errors)
        and not err.died
        and all(diagnosis.raised_by_loop(t) for t in err.errors.values())
    )
    outcome = "died" if err.died else "loop raised" if by_loop else "engine raised"
    why = diagnosis.crash(case, stage, hang=False, by_loop=by_loop)
    return CaseResult(stage, case.name, outcome, None, [why], detail)


def _judge(stage, case, got, reference, right, config, gas) -> CaseResult:
    """A finished case: one step per call on every rank, the ranks agree, the reference reached."""
    took = [r["took"] for r in got]
    if any(t != 1 for per_rank in took for t in per_rank):
        why = (
            f"the engine's global_steps advanced by {took} per call on ranks 0, 1: the contract "
            "is one optimizer step per call, engine.step() once after the micro-batches"
        )
        return CaseResult(stage, case.name, "not one step", None, [why])
    params = got[0]["params"]
    if not agrees(got[1]["params"], params):
        why = (
            "the ranks ended with different weights: every rank must call engine.step() after "
            "the same backward() calls"
        )
        error = relative_error(got[1]["params"], params)
        return CaseResult(stage, case.name, "ranks differ", error, [why])
    error = relative_error(params, reference)
    if error <= RTOL:
        return CaseResult(stage, case.name, PASS, error)
    if error == float("inf"):
        why = (
            "the weights are NaN or inf: most often a division by a count that is 0 on some "
            "rank or micro-batch (a rank without micro-batches, a sequence without labels)"
        )
        return CaseResult(stage, case.name, "not finite", error, [why])
    said = diagnosis.wrong_weights(BY_NAME[case.name], params, right, config, gas)
    return CaseResult(stage, case.name, "wrong weights", error, said)


__all__ = ["CheckResult", "check_loop"]
