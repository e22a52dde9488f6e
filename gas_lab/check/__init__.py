"""Check your own loop: does one optimizer step of it equal the objective you declare?

``python -m gas_lab.check FILE.py:FUNCTION`` (in a notebook or a pytest test,
:func:`check_loop`) runs your function on W CPU ranks (2 by default; gloo, no launcher needed)
at each ZeRO stage asked, on cases chosen to separate the known normalization mistakes, and
compares the weights it ends with against one process computing the declared objective over the
whole step.

**The contract.** ``FUNCTION(engine, micro_batches)`` runs *one optimizer step on one rank* in
unmanaged mode (``"managed_gradient_accumulation": false``): ``engine.backward(loss)`` for each
micro-batch, then ``engine.step()`` once. It may use ``torch.distributed`` (the process group
is initialized). ``micro_batches`` is that rank's list, possibly empty, of dicts as trainers
carry them, each value ``[B, T]`` (``T`` may differ between micro-batches)::

    {"input_ids": LongTensor,
     "labels": LongTensor,           # -100: no target here
     "attention_mask": LongTensor,   # 1: a real position, 0: padding
     "position_ids": LongTensor,     # from 0 in each document (a packed row holds several)
     "loss_mask": LongTensor}        # 1 exactly where labels has a target, 0 elsewhere

The engine wraps one of two models (``model=``), and ``engine(**micro_batch)`` works as well as
``engine(input_ids)``; the model ignores the keys it does not use:

* ``"toy"`` (the default): the engine returns the logits tensor ``[B, T, V]`` however it is
  called, and ``labels[b, t]`` is the target of ``logits[b, t]`` (no shift).
* ``"hf"``: a tiny transformers ``LlamaForCausalLM`` built from a config (``pip install
  'gas_lab[hf]'``; nothing is downloaded). The engine returns transformers' output, so a loop
  written the Hugging Face way runs unchanged: ``out = engine(**micro_batch)``, ``out.logits``,
  and ``out.loss`` (a mean over the targets, or, given ``num_items_in_batch=N``, their sum over
  N). Labels follow transformers' convention: they are the input ids, and the model shifts them
  (``logits[b, t - 1]`` predicts ``labels[b, t]``); no target sits at position 0, so every
  target counts after the shift. Call it with the micro-batch's ``position_ids`` (and mask):
  the reference does, and on packed rows the logits depend on them.

The engine averages the ranks' gradients, as DeepSpeed does. The config is the checker's (SGD,
lr 1, one micro-batch per engine step, no clipping, the stage under test), or yours
(``config=``), with only the ZeRO stage and unmanaged accumulation set; the reference then uses
your optimizer and clipping.

**The objective.** Either a built-in ``reduction`` (:mod:`~gas_lab.check.objectives`):
``token``, the mean cross-entropy over every target of the whole step (every rank, every
micro-batch); ``sequence``, the mean over sequences (documents) of each one's own token mean;
``microbatch-mean``, each micro-batch's own token mean averaged over every micro-batch of every
rank (DeepSpeed's managed mode with a per-micro-batch mean loss); ``sum``, the total;
``token-sum/sequences``, the total divided by the number of sequences. Or your own
``objective=FUNCTION``: ``FUNCTION(ranks)`` gets the whole step (``ranks[r]`` is rank r's list of
micro-batches) and returns per-target weights in the same nesting (``[B, T]`` tensors laid out as
``labels``); the objective is the sum of weight x cross-entropy. ``constant=C`` divides any of
them by C. A sequence (for ``microbatch-mean``, a micro-batch) with no target left is not
counted unless ``count_empty_sequences=True``.

**The verdict** per stage and case: PASS when every parameter agrees with the reference to a
relative 1e-5; otherwise the case, the error, and a diagnosis computed by replaying the known
wrong normalizations against the declared objective (:mod:`~gas_lab.check.diagnosis`).
``equal_counts=True`` runs only the cases where every rank has the same number of micro-batches
(for trainers that guarantee it). ``world_size=N`` (2 to 4) runs the cases on N ranks: a world
size written into the loop shows only where W is not 2.
"""

from __future__ import annotations

import importlib.metadata
import time

from tqdm.auto import tqdm

from gas_lab.check import diagnosis, models
from gas_lab.check.cases import BY_NAME, MAX_WORLD_SIZE, WORLD_SIZE, chosen
from gas_lab.check.objectives import REDUCTIONS, Objective
from gas_lab.check.report import CaseResult, CheckResult, Outcome
from gas_lab.check.trial import RTOL, agrees, config_for, relative_error, trial
from gas_lab.runtime.cluster import start_cluster
from gas_lab.runtime.rank_errors import RankError, RankStallError

CASE_TIMEOUT_S = 20.0  # a case takes about a second; a rank that waits longer than this stalled
LIBRARIES = ("deepspeed", "gas_lab")
MODELS = models.MODELS


def declared(reduction, objective, constant, count_empty_sequences) -> Objective:
    """The declaration as an :class:`~gas_lab.check.objectives.Objective`; ValueError naming
    the argument that is wrong."""
    if objective is not None and reduction is not None:
        raise ValueError(f"reduction {reduction!r}: declare a reduction or an objective, not both")
    if constant is not None and not constant > 0:
        raise ValueError(f"constant {constant!r}: a number > 0")
    c = float(constant or 1.0)
    if objective is not None:
        if not callable(objective):
            raise ValueError(f"objective {objective!r}: a function of the step's ranks")
        name = getattr(objective, "__gas_lab_name__", None) or getattr(
            objective, "__qualname__", repr(objective)
        )
        return Objective(name, objective, c, count_empty_sequences)
    reduction = "token" if reduction is None else reduction
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r}: choose from {', '.join(REDUCTIONS)}")
    return Objective(reduction, None, c, count_empty_sequences)


def check_arguments(
    reduction=None,
    stages=(0, 1, 2),
    library="deepspeed",
    constant=None,
    config=None,
    *,
    objective=None,
    count_empty_sequences=False,
    model="toy",
    world_size=WORLD_SIZE,
    case_timeout=CASE_TIMEOUT_S,
    cases=None,
) -> tuple[tuple[int, ...], Objective]:
    """Raise ValueError naming the argument that is wrong; return the stages as a tuple and the
    declared objective (a user's is called once on a case, to check what it returns)."""
    if library not in LIBRARIES:
        raise ValueError(f"library {library!r}: choose from {', '.join(LIBRARIES)}")
    if model not in MODELS:
        raise ValueError(f"model {model!r}: choose from {', '.join(MODELS)}")
    if model == "hf" and models.transformers_version() is None:
        raise ValueError("model 'hf': needs transformers (pip install 'gas_lab[hf]')")
    stages = tuple(stages)
    top = 3 if library == "deepspeed" else 2
    if not stages or any(not isinstance(s, int) or not 0 <= s <= top for s in stages):
        raise ValueError(
            f"stages {list(stages)}: each a ZeRO stage from 0 to {top}"
            + (" (gas_lab builds stages 0-2)" if library == "gas_lab" else "")
        )
    if not isinstance(world_size, int) or not 2 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world-size {world_size!r}: a number of ranks from 2 to {MAX_WORLD_SIZE}")
    if not isinstance(case_timeout, (int, float)) or not case_timeout > 0:
        raise ValueError(f"case-timeout {case_timeout!r}: seconds > 0")
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"config: a DeepSpeed config dict, got {type(config).__name__}")
    if cases is not None and (not cases or any(c not in BY_NAME for c in cases)):
        raise ValueError(f"cases {list(cases)}: choose from {', '.join(BY_NAME)}")
    right = declared(reduction, objective, constant, count_empty_sequences)
    if not right.builtin:  # what it returns, on every case, before any rank starts
        for case in BY_NAME.values():
            for step in case.data(0, world_size, models.CONVENTION[model]):
                try:
                    right.weights(step)
                except ValueError:
                    raise
                except Exception as err:  # the user's function failed: name it, and why
                    raise ValueError(
                        f"objective {right.name}: raised {type(err).__name__}: {err} "
                        f"on case '{case.name}'"
                    ) from None
    return stages, right


def versions() -> dict:
    def of(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {n: of(n) for n in ("gas_lab", "deepspeed", "torch", "transformers")}


def _import(library: str, model: str) -> None:
    """On every rank: the slow imports (and DeepSpeed's first C++ build) before any case."""
    from gas_lab.measure.parity import initializer

    initializer(library)
    models.build(model)


def check_loop(
    fn,
    reduction: str | None = None,
    stages=(0, 1, 2),
    *,
    objective=None,
    constant: float | None = None,
    count_empty_sequences: bool = False,
    equal_counts: bool = False,
    library: str = "deepspeed",
    model: str = "toy",
    world_size: int = WORLD_SIZE,
    config: dict | None = None,
    case_timeout: float = CASE_TIMEOUT_S,
    cases=None,
    cluster=None,
    progress: bool = True,
) -> CheckResult:
    """Check ``fn(engine, micro_batches)`` (the contract: this module's docstring) against the
    declared ``reduction`` (``"token"`` when neither it nor ``objective`` is given) on the
    notebook's ranks (``cluster``, or ``world_size`` CPU ranks started for it); returns a
    :class:`~gas_lab.check.report.CheckResult`, which a notebook shows as a table. ``cases``
    names the cases to run (all of them by default; a test of one behaviour needs one)."""
    stages, right = check_arguments(
        reduction,
        stages,
        library,
        constant,
        config,
        objective=objective,
        count_empty_sequences=count_empty_sequences,
        model=model,
        world_size=world_size,
        case_timeout=case_timeout,
        cases=cases,
    )
    run = [c for c in chosen(equal_counts, world_size) if cases is None or c.name in cases]
    if not run:
        raise ValueError(
            f"cases {list(cases)}: none of them has equal counts at {world_size} ranks"
        )
    t0 = time.perf_counter()
    cluster = cluster or start_cluster(world_size=world_size, device="cpu")
    if cluster.world_size != world_size:
        raise ValueError(
            f"cluster: it has {cluster.world_size} ranks, the check asks for world_size="
            f"{world_size}"
        )
    cfg = config_for(0, config)
    gas = int(cfg.get("gradient_accumulation_steps") or 1)
    averaged = str(cfg.get("gradient_allreduce_op", "mean")).lower() != "sum"
    replays = diagnosis.Replays(config, model, world_size, models.CONVENTION[model])
    cluster.run(_import, library, model, timeout=600)
    results = []
    todo = [(s, c) for s in stages for c in run]
    bar = tqdm(total=len(todo), unit="case", leave=False, disable=not progress)
    for stage, case in todo:
        bar.set_description(f"stage {stage}, {case.name}")
        try:
            got = cluster.run(
                trial, fn, case.name, stage, library, config, model, timeout=case_timeout
            )
            reference = replays.reference(case, right)  # the same at every stage
            judged = _judge(stage, case, got, reference, right, replays, gas, averaged)
        except (RankError, RankStallError) as err:
            judged = _failed(stage, case, err, world_size)
            cluster.run(_import, library, model, timeout=600)  # ranks restarted: warm them
        judged.world_size = world_size
        results.append(judged)
        bar.update()
    bar.close()
    _keep_what_every_case_says(results, right.count_empty)
    declaration = {
        "objective": None if right.builtin else right.name,
        "reduction": right.name if right.builtin else None,
        "constant": constant,
        "count_empty_sequences": count_empty_sequences,
        "equal_counts": equal_counts,
        "cases": None if cases is None else list(cases),
        "stages": list(stages),
        "library": library,
        "model": model,
        "world_size": world_size,
        "case_timeout": case_timeout,
        "config": config_for(stages[0], config),
        "config_given": config is not None,
    }
    return CheckResult(declaration, results, time.perf_counter() - t0, versions())


def _keep_what_every_case_says(results: list[CaseResult], count_empty: bool) -> None:
    """Where one case fits several known mistakes (an idle rank's own token count is every
    rank's), keep those that fit every wrong case of the stage: the loop made one mistake.
    Where none fits them all, each case keeps its own, said to be diagnosed alone (a fixed
    denominator only where it is the same number in every case)."""
    for stage in {r.stage for r in results}:
        wrong = [r for r in results if r.stage == stage and r.outcome == Outcome.WRONG_WEIGHTS]
        if not wrong:
            continue
        common = set.intersection(*({f.key for f in r.findings} for r in wrong))
        common.discard(None)
        if len(wrong) == 1 and len(common) > 1:  # one case cannot show a number is fixed
            common = {k for k in common if not (isinstance(k, tuple) and k[0] == "fixed")}
        for r in wrong:
            if common:
                r.findings = [f for f in r.findings if f.key in common]
            else:  # a fixed number that differs between cases is no fixed number
                r.findings = [f for f in r.findings if not f.fixed] or [
                    diagnosis.Finding(diagnosis.NONE_KNOWN, None, 99)
                ]
                r.diagnosed_alone = len(wrong) > 1
            r.diagnosis = diagnosis.kept(r.findings, count_empty)


def _failed(stage, case, err, world_size) -> CaseResult:
    """A case the ranks did not finish: the loop or the engine raised, a rank died, or a hang
    (``RankStallError``); its traceback first, then what that means at this stage."""
    detail = "\n".join(err._render_traceback_())
    if isinstance(err, RankStallError):
        why = diagnosis.crash(case, stage, True, world_size=world_size)
        return CaseResult(stage, case.name, Outcome.HANG, None, [why], detail)
    by_loop = (
        bool(err.errors)
        and not err.died
        and all(diagnosis.raised_by_loop(t) for t in err.errors.values())
    )
    outcome = (
        Outcome.DIED if err.died else Outcome.LOOP_RAISED if by_loop else Outcome.ENGINE_RAISED
    )
    why = diagnosis.crash(case, stage, hang=False, by_loop=by_loop, world_size=world_size)
    return CaseResult(stage, case.name, outcome, None, [why], detail)


def _judge(stage, case, got, reference, right, replays, gas, averaged) -> CaseResult:
    """A finished case: one step per call on every rank, the ranks agree, the reference reached."""
    took = [r["took"] for r in got]
    if any(t != 1 for per_rank in took for t in per_rank):
        ranks = ", ".join(str(r) for r in range(len(got)))
        why = (
            f"the engine's global_steps advanced by {took} per call on ranks {ranks}: the "
            "contract is one optimizer step per call, engine.step() once after the micro-batches"
        )
        return CaseResult(stage, case.name, Outcome.NOT_ONE_STEP, None, [why])
    params = got[0]["params"]
    for other in got[1:]:
        if not agrees(other["params"], params):
            why = (
                "the ranks ended with different weights: every rank must call engine.step() "
                "after the same backward() calls"
            )
            error = relative_error(other["params"], params)
            return CaseResult(stage, case.name, Outcome.RANKS_DIFFER, error, [why])
    error = relative_error(params, reference)
    if error <= RTOL:
        return CaseResult(stage, case.name, Outcome.PASS, error)
    if error == float("inf"):
        why = (
            "the weights are NaN or inf: most often a division by a count that is 0 on some "
            "rank or micro-batch (a rank without micro-batches, a micro-batch or a sequence "
            "without labels: a mean loss over no target is 0/0)"
        )
        return CaseResult(stage, case.name, Outcome.NOT_FINITE, error, [why])
    calls = [flag for r in got for flag in r["scaled"]]
    scaled = any(calls) if calls else None
    found = diagnosis.wrong_weights(case, params, right, replays, gas, scaled, averaged)
    result = CaseResult(stage, case.name, Outcome.WRONG_WEIGHTS, error)
    result.findings = found
    result.diagnosis = diagnosis.kept(found, right.count_empty)
    return result


__all__ = ["CheckResult", "check_loop"]
