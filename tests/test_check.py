"""gas_lab.check (issue 28): a practitioner's loop against the declared objective.

Without ranks: the objectives' weights, the cases, every diagnosis, the command's bad usages.
On the session's ranks: right loops pass at stages 0-2 on both libraries with the same verdicts,
wrong ones get their diagnosis, a loop that raises shows its own traceback first, and one that
hangs is stopped within the bound. The command end to end, in a process of its own."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import check_loops
import psutil
import pytest
import torch
from exercise_support import load_solutions

from gas_lab.check import CASE_TIMEOUT_S, check_loop, diagnosis
from gas_lab.check.__main__ import main
from gas_lab.check.cases import BY_NAME, CASES, chosen
from gas_lab.check.objectives import REDUCTIONS, mistakes, objective
from gas_lab.check.trial import agrees, default_config, replay

LOOPS = Path(check_loops.__file__)


# -- without ranks ----------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_the_weights_average_to_the_declared_objective(reduction):
    """(1/W) * sum of weight * cross-entropy over every rank is the objective, computed the
    plain way from random cross-entropies."""
    step = BY_NAME["empty sequences"].data()[0]
    ce = {
        (r, m): torch.rand(mb["labels"].shape)
        for r, mbs in enumerate(step.ranks)
        for m, mb in enumerate(mbs)
    }
    n = objective(reduction, constant=3.0)
    got = sum((n.weights(step, r, m) * ce[r, m]).sum() for r, m in ce) / step.world_size
    mask = {k: (step.ranks[k[0]][k[1]]["labels"] != -100).float() for k in ce}
    tokens = sum((ce[k] * mask[k]).sum() for k in ce)
    per_seq = [
        ((ce[k] * mask[k]).sum(1) / mask[k].sum(1).clamp(min=1))[mask[k].sum(1) > 0] for k in ce
    ]
    sequences = sum(len(s) for s in per_seq)
    want = {
        "token": tokens / sum(m.sum() for m in mask.values()),
        "sequence": sum(s.sum() for s in per_seq) / sequences,
        "sum": tokens,
        "token-sum/sequences": tokens / sequences,
    }[reduction] / 3.0
    assert torch.isclose(got, want, rtol=1e-6), (got, want)


def test_no_two_micro_batches_or_ranks_of_a_step_hold_the_same_number_of_tokens():
    for case in CASES:
        for step in case.steps:
            tokens = [sum(mb) for mbs in step for mb in mbs]
            ranks = [sum(map(sum, mbs)) for mbs in step]
            assert len(set(tokens)) == len(tokens), case.name
            assert len(set(ranks)) == len(ranks), case.name


def test_equal_counts_keeps_only_the_cases_where_every_rank_runs_as_many():
    kept = chosen(equal_counts=True)
    assert {c.name for c in kept} == {"equal", "empty sequences", "two steps"}
    assert all(len(set(n)) == 1 for c in kept for n in c.counts())


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_the_cases_separate_every_known_mistake_from_the_objective(reduction):
    """Each mistake lands somewhere else than the objective in at least one case, so no known
    mistake passes the check."""
    right, config = objective(reduction), default_config(0)
    ref = {c.name: replay(c.data(), right, config) for c in CASES}
    for n in mistakes(right, gas=4, steps=2):
        assert any(not agrees(replay(c.data(), n, config), ref[c.name]) for c in CASES), n


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_every_known_mistake_is_named_by_its_own_diagnosis(reduction):
    """The parameters a mistake leads to (replayed in one process, as a loop making it would
    reach them) get a diagnosis that says what that mistake does differently."""
    from gas_lab.check.objectives import differences

    right, case = objective(reduction), BY_NAME["unequal"]
    config = {**default_config(0), "gradient_accumulation_steps": 4}
    named = {objective(r): r for r in REDUCTIONS}
    for n in mistakes(right, gas=4, steps=1):
        said = diagnosis.wrong_weights(case, replay(case.data(), n, config), right, config, 4)
        want = (
            f"the loop computes the '{named[n]}' objective"
            if n in named
            else "the loop " + "; and ".join(differences(n, right))
        )
        assert any(s.startswith(want) for s in said), (n, said)


def test_a_step_no_known_mistake_makes_gets_none_known():
    right, case = objective("token"), BY_NAME["equal"]
    params = replay(case.data(), right, default_config(0)) * 1.5
    assert diagnosis.wrong_weights(case, params, right, None, 1) == [diagnosis.NONE_KNOWN]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        ([f"{LOOPS}:no_such_loop"], "no function 'no_such_loop'"),
        (["/no/such/file.py:step"], "no such file"),
        (
            [f"{LOOPS}:wrong_signature"],
            "cannot be called as wrong_signature(engine, micro_batches)",
        ),
        ([f"{LOOPS}:right_token", "--reduction", "median"], "--reduction 'median'"),
        ([f"{LOOPS}:right_token", "--stages", "0,4"], "--stages [0, 4]"),
        ([f"{LOOPS}:right_token", "--config", __file__], "--config"),
    ],
)
def test_bad_usage_is_one_line_naming_the_argument_and_exit_2(argv, names, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err and err.startswith("gas_lab.check: error: ")


# -- on the session's ranks -------------------------------------------------------------------
@pytest.mark.ranks
def test_right_loops_pass_at_stages_0_to_2_on_both_libraries(cluster):
    for fn, reduction in (
        (check_loops.right_token, "token"),
        (load_solutions("appendix_a6").sequence_step, "sequence"),
    ):
        for library in ("deepspeed", "gas_lab"):
            result = check_loop(fn, reduction, cluster=cluster, library=library, progress=False)
            assert result.ok, str(result)
            assert len(result.results) == 15


@pytest.mark.ranks
def test_both_libraries_give_a_wrong_loop_the_same_verdicts(cluster):
    verdicts = {}
    for library in ("deepspeed", "gas_lab"):
        result = check_loop(
            check_loops.mean_of_means, cluster=cluster, library=library, progress=False
        )
        verdicts[library] = [(r.stage, r.case, r.outcome, r.diagnosis) for r in result.results]
    assert verdicts["deepspeed"] == verdicts["gas_lab"]
    assert any("a mean of micro-batch means" in d for *_, ds in verdicts["gas_lab"] for d in ds)


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("loop", "says"),
    [
        ("mean_of_means", "this rank's number of micro-batches (a mean of micro-batch means)"),
        ("own_tokens", "divides each micro-batch's summed loss by this rank's own labelled tokens"),
        ("no_world_factor", "does not multiply by the world size W"),
    ],
)
def test_a_wrong_loop_gets_the_diagnosis_of_its_mistake(cluster, loop, says):
    result = check_loop(getattr(check_loops, loop), stages=(1,), cluster=cluster, progress=False)
    assert not result.ok
    assert all(r.outcome == "wrong weights" for r in result.failures())
    assert any(says in d for r in result.failures() for d in r.diagnosis), str(result)


@pytest.mark.ranks
def test_backward_dividing_by_gas_is_named(cluster):
    config = {**default_config(0), "gradient_accumulation_steps": 4}
    result = check_loop(
        check_loops.right_token,
        stages=(0,),
        config=config,
        cluster=cluster,
        equal_counts=True,
        progress=False,
    )
    assert not result.ok
    assert all(
        any("gradient_accumulation_steps (4)" in d for d in r.diagnosis) for r in result.failures()
    )


@pytest.mark.ranks
def test_a_loop_right_only_for_equal_counts_gets_that_verdict_by_name(cluster):
    result = check_loop(check_loops.unpadded_token, cluster=cluster, progress=False)
    assert result.stage_verdict(0) == "PASS"
    for stage in (1, 2):
        assert result.stage_verdict(stage).startswith("right only when every rank runs the same")
    idle = next(r for r in result.results if r.stage == 1 and r.case == "idle rank")
    assert "runs one zero-weight micro-batch" in idle.diagnosis[0]
    assert check_loop(
        check_loops.unpadded_token, cluster=cluster, equal_counts=True, progress=False
    ).ok


@pytest.mark.ranks
def test_a_loop_that_raises_shows_its_own_traceback_first(cluster):
    result = check_loop(check_loops.raises, stages=(0,), cluster=cluster, progress=False)
    failure = result.failures()[0]
    assert failure.outcome == "loop raised"
    lines = failure.detail.splitlines()
    assert lines[0].startswith("Traceback on rank 0")
    assert "in raises" in failure.detail and "ValueError: the loop's own mistake" in failure.detail
    assert "(the same at stage 0 'unequal'" in str(result)  # each failure once


@pytest.mark.ranks
def test_a_loop_that_calls_step_twice_breaks_the_contract(cluster):
    result = check_loop(
        check_loops.two_steps, stages=(0,), cluster=cluster, equal_counts=True, progress=False
    )
    assert {r.outcome for r in result.results} == {"not one step"}


@pytest.mark.ranks
def test_a_loop_that_hangs_is_stopped_within_the_bound(cluster):
    t0 = time.perf_counter()
    result = check_loop(check_loops.hangs_when_idle, stages=(0,), cluster=cluster, progress=False)
    hung = [r for r in result.failures()]
    assert [(r.case, r.outcome) for r in hung] == [("idle rank", "hang")]
    assert "every rank must call it" in hung[0].diagnosis[0]
    assert time.perf_counter() - t0 < CASE_TIMEOUT_S + 60


# -- the command --------------------------------------------------------------------------------
def _processes_with_tmpdir(tmp: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TMPDIR") == tmp:
                out.append(p)
        except (psutil.Error, OSError):
            pass
    return out


@pytest.mark.ranks
@pytest.mark.parametrize(("loop", "code"), [("right_token", 0), ("hangs_when_idle", 1)])
def test_the_command_exits_0_or_1_and_leaves_no_process(tmp_path, loop, code):
    env = {**os.environ, "TMPDIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    run = subprocess.run(
        [sys.executable, "-m", "gas_lab.check", f"{LOOPS}:{loop}", "--stages", "0", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == code, run.stderr[-3000:]
    doc = json.loads(run.stdout)
    assert doc["ok"] is (code == 0) and doc["stages"] == [0]
    if code:
        assert [r["outcome"] for r in doc["results"] if r["outcome"] != "PASS"] == ["hang"]
    time.sleep(2)  # the guardian ends what the command started once it is gone
    assert _processes_with_tmpdir(str(tmp_path)) == []
