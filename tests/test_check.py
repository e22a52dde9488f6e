"""gas_lab.check (issues 28, 35): a practitioner's loop against the declared objective.

Without ranks: the objectives' weights, the cases and what each separates, every diagnosis, the
report's text and JSON, the command's bad usages. On the session's ranks: right loops pass at
stages 0-2 on both libraries and both models, every supported way of calling the model, wrong
ones get their diagnosis, a loop that raises shows its own traceback first, one that hangs is
stopped within the bound; the README's pytest snippet as written; 3 ranks. The command end to
end, in a process of its own."""

import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import check_loops
import psutil
import pytest
import torch

from gas_lab.check import CASE_TIMEOUT_S, check_loop, diagnosis, report
from gas_lab.check.__main__ import main
from gas_lab.check.cases import BY_NAME, CASES, NEW, chosen
from gas_lab.check.diagnosis import Replays
from gas_lab.check.mistakes import describe, differences, mistakes
from gas_lab.check.objectives import (
    REDUCTIONS,
    Normalization,
    Objective,
    reduction,
)
from gas_lab.check.report import CaseResult, CheckResult, Outcome
from gas_lab.check.trial import agrees, default_config

LOOPS = Path(check_loops.__file__)
ROOT = Path(__file__).resolve().parents[1]


def close(a, b) -> bool:
    return all(
        torch.allclose(x, y, rtol=1e-6, atol=0)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


@functools.cache
def _data(name: str, world_size: int):
    return BY_NAME[name].data(0, world_size)


@functools.cache
def _objective_weights(name: str, right: Objective, world_size: int):
    return [right.weights(s) for s in _data(name, world_size)]


def same_weights(case, n: Normalization, right: Objective, world_size: int = 2) -> bool:
    steps = _data(case.name, world_size)
    want = _objective_weights(case.name, right, world_size)
    return all(close(n.weights(s), w) for s, w in zip(steps, want, strict=True))


# -- without ranks: the objectives ------------------------------------------------------------
@pytest.mark.parametrize("name", REDUCTIONS)
def test_the_weights_sum_to_the_declared_objective(name):
    """sum of weight * cross-entropy over every rank is the objective, computed the plain way
    from random cross-entropies, on steps with packed rows and an empty micro-batch."""
    for case in (BY_NAME["packed"], BY_NAME["empty micro-batch"], BY_NAME["holes"]):
        step = case.data(0, 3)[0]
        ce = {(r, m): torch.rand(mb["labels"].shape) for r, mbs in enumerate(step.ranks)
              for m, mb in enumerate(mbs)}  # fmt: skip
        weights = Objective(name, constant=3.0).weights(step)
        got = sum((weights[r][m] * ce[r, m]).sum() for r, m in ce)
        on = {k: step.ranks[k[0]][k[1]]["loss_mask"].float() for k in ce}
        tokens = sum((ce[k] * on[k]).sum() for k in ce)
        docs, means, mbs = [], [], []  # the plain way: walk every row's documents
        for k in ce:
            mb = step.ranks[k[0]][k[1]]
            n_mb = on[k].sum()
            if n_mb > 0:
                mbs.append((ce[k] * on[k]).sum() / n_mb)
            for b in range(mb["labels"].shape[0]):
                starts = [t for t in range(mb["labels"].shape[1])
                          if mb["position_ids"][b, t] == 0 and mb["attention_mask"][b, t]]  # fmt: skip
                ends = starts[1:] + [int(mb["attention_mask"][b].sum())]
                for s, e in zip(starts, ends, strict=True):
                    n = on[k][b, s:e].sum()
                    if n > 0:
                        docs.append(n)
                        means.append((ce[k][b, s:e] * on[k][b, s:e]).sum() / n)
        want = {
            "token": tokens / sum(m.sum() for m in on.values()),
            "sequence": sum(means) / len(means),
            "microbatch-mean": sum(mbs) / len(mbs),
            "sum": tokens,
            "token-sum/sequences": tokens / len(docs),
        }[name] / 3.0
        assert torch.isclose(got, want, rtol=1e-6), (case.name, got, want)


def test_each_reduction_is_a_recipe_a_right_loop_follows():
    """A built-in reduction's weights are its loop recipe's (times W) averaged by the engine."""
    step = BY_NAME["unequal"].data(0, 4)[0]
    for name in REDUCTIONS:
        loop = reduction(name).loop_weights(step)
        got = Objective(name).weights(step)
        assert close([[w / 4 for w in row] for row in loop], got), name


# -- the cases ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_no_two_micro_batches_or_ranks_of_a_step_hold_the_same_number_of_tokens(world_size):
    for case in CASES:
        for step in case.data(0, world_size):
            tokens = [int(mb["loss_mask"].sum()) for mb in step.every()]
            ranks = [sum(int(mb["loss_mask"].sum()) for mb in mbs) for mbs in step.ranks]
            assert len(set(tokens)) == len(tokens), case.name
            assert len(set(ranks)) == len(ranks), case.name


def test_every_micro_batch_carries_what_trainers_carry_in_both_conventions():
    for case in CASES:
        for convention in ("toy", "hf"):
            for mb in case.data(0, 2, convention)[0].every():
                assert set(mb) == {"input_ids", "labels", "attention_mask", "position_ids",
                                   "loss_mask"}  # fmt: skip
                assert torch.equal(mb["loss_mask"].bool(), mb["labels"] != -100)
                if convention == "hf":  # labels are the inputs; nothing the shift drops
                    on = mb["labels"] != -100
                    assert torch.equal(mb["labels"][on], mb["input_ids"][on])
                    assert not on[:, 0].any()
    assert len({mb["labels"].shape[1] for mb in BY_NAME["lengths"].data()[0].every()}) > 1
    packed = BY_NAME["packed"].data()[0].every()
    assert all(((mb["position_ids"] == 0) & (mb["attention_mask"] > 0)).sum(1).max() >= 2
               for mb in packed)  # fmt: skip


def test_equal_counts_keeps_only_the_cases_where_every_rank_runs_as_many():
    for world_size in (2, 3):
        kept = chosen(equal_counts=True, world_size=world_size)
        want = [c for c in CASES if all(len(set(n)) == 1 for n in c.counts(world_size))]
        assert kept == want and 0 < len(kept) < len(CASES)


@pytest.mark.parametrize("name", ["token", "sequence", "microbatch-mean"])
def test_the_cases_separate_every_known_mistake_from_the_objective(name):
    """Each mistake lands somewhere else than the objective in at least one case, so no known
    mistake passes the check (the first case whose weights differ is replayed)."""
    right = Objective(name)
    replays = Replays(None, "toy", 2, "toy")
    for n in mistakes(right, 2, gas=4, steps=2):
        case = next(c for c in CASES if not same_weights(c, n, right))
        weights = [n.weights(s) for s in replays.data(case)]
        assert not agrees(replays.params(case, weights), replays.reference(case, right)), n


# Each case issue 35 added, and the 3-rank run, with a mistake only it shows.
DECLARATIONS = [
    Objective("token"),
    Objective("sequence"),
    Objective("microbatch-mean"),
    Objective("token-sum/sequences", constant=10.0, count_empty=True),  # Dr. GRPO, C = LENGTH
]
ONLY_HERE = {  # the test below finds these from the data; they name what each case is for
    "holes": "completion positions",
    "empty micro-batch": "tokens, empty micro-batch as one",
    "packed": "row means",
    "lengths": "sequences x width",
}


def test_each_new_case_separates_a_known_mistake_that_no_other_case_separates():
    """From the data, for each case issue 35 added: some declared objective and some known
    mistake whose weights equal the objective's in every other case but not in this one, and
    whose replay there is off the reference."""
    found = {}
    for right in DECLARATIONS:
        for n in mistakes(right, 2):
            apart = [c.name for c in CASES if not same_weights(c, n, right)]
            if len(apart) == 1 and apart[0] in NEW:
                found.setdefault(apart[0], []).append((right.name, n))
    assert set(found) == set(NEW), set(NEW) - set(found)
    replays = Replays(None, "toy", 2, "toy")
    for name, pairs in found.items():
        assert any(n.denominator == ONLY_HERE[name] for _, n in pairs), (name, pairs)
        right_name, n = pairs[0]
        right = next(d for d in DECLARATIONS if d.name == right_name)
        case = BY_NAME[name]
        weights = [n.weights(s) for s in replays.data(case)]
        assert not agrees(replays.params(case, weights), replays.reference(case, right))


def test_three_ranks_separate_a_world_size_written_into_the_loop():
    """Multiplying by 2 is multiplying by W on 2 ranks, in every case; on 3 it is not."""
    right, two = Objective("token"), Normalization("tokens", factor=2)
    assert two not in mistakes(right, 2) and two in mistakes(right, 3)
    assert all(same_weights(c, two, right, 2) for c in CASES)
    assert not any(same_weights(c, two, right, 3) for c in CASES)


# -- the diagnosis ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["token", "sequence"])
def test_every_known_mistake_is_named_by_its_own_diagnosis(name):
    """The parameters a mistake leads to (replayed in one process, as a loop making it would
    reach them) get a diagnosis that names that mistake, in its words."""
    right, case = Objective(name), BY_NAME["holes"]
    config = {**default_config(0), "gradient_accumulation_steps": 4}
    replays = Replays(config, "toy", 2, "toy")
    named = {reduction(r): r for r in REDUCTIONS}
    for n in mistakes(right, 2, gas=4):
        if same_weights(case, n, right):
            continue
        weights = [n.weights(s) for s in replays.data(case)]
        found = diagnosis.wrong_weights(case, replays.params(case, weights), right, replays, 4,
                                        scaled=n.gas == 4)  # fmt: skip
        plain = Normalization(n.denominator, n.factor, n.constant, 1, n.count_empty)
        said = differences(n, right.recipe, 2)
        if plain in named and plain != right.recipe:
            said = said[:1] if n.gas != 1 else []
            said.append(f"computes the '{named[plain]}' objective, not the one declared")
        assert any(f.key == n and f.words == "the loop " + "; and ".join(said) for f in found), (
            n,
            [f.words for f in found],
        )


def test_with_gas_the_mechanism_comes_first_and_no_factor_the_loop_lacks():
    """A loop whose backward() divided by GAS (seen on the ranks) gets only diagnoses with that
    division, said first; one that passed scale_wrt_gas=False gets none with it."""
    right, case = Objective("token"), BY_NAME["unequal"]
    config = {**default_config(0), "gradient_accumulation_steps": 4}
    replays = Replays(config, "toy", 2, "toy")
    n = Normalization("micro-batch tokens", factor=1, gas=4)
    params = replays.params(case, [n.weights(s) for s in replays.data(case)])
    found = diagnosis.wrong_weights(case, params, right, replays, 4, scaled=True)
    assert found[0].key == n
    assert found[0].words.startswith("the loop is divided by gradient_accumulation_steps (4)")
    assert all(f.key.gas == 4 for f in found if isinstance(f.key, Normalization))
    unscaled = diagnosis.wrong_weights(case, params, right, replays, 4, scaled=False)
    assert all(f.key is None or f.key.gas == 1 for f in unscaled if not f.fixed)


def test_a_fixed_denominator_is_fitted_and_said_once_for_every_case():
    """Dividing by a fixed 8 is found in each case, as the same number, and no world-size
    factor is blamed for it."""
    right = Objective("token-sum/sequences")
    replays = Replays(None, "toy", 2, "toy")
    results = []
    for case in CASES[:3]:
        params = replays.params(case, [[[mb["loss_mask"].float() / 8 / 2 for mb in mbs]
                                        for mbs in s.ranks] for s in replays.data(case)])  # fmt: skip
        r = CaseResult(0, case.name, Outcome.WRONG_WEIGHTS, 0.1)
        r.findings = diagnosis.wrong_weights(case, params, right, replays)
        results.append(r)
    from gas_lab.check import _keep_what_every_case_says

    _keep_what_every_case_says(results, False)
    said = {tuple(r.diagnosis) for r in results}
    assert len(said) == 1 and "by the same number, 8," in said.pop()[0]
    assert not any(r.diagnosed_alone for r in results)


def test_a_step_no_known_mistake_makes_gets_none_known():
    right, case = Objective("token"), BY_NAME["equal"]
    replays = Replays(None, "toy", 2, "toy")
    params = replays.reference(case, right)
    params = params + torch.linspace(0, 1, len(params)) * params.abs().mean()
    found = diagnosis.wrong_weights(case, params, right, replays)
    assert [f.words for f in found] == [diagnosis.NONE_KNOWN]


def test_a_user_objective_is_diagnosed_in_full_words():
    right = Objective("mine", lambda ranks: [[mb["loss_mask"] / 50.0 for mb in mbs]
                                             for mbs in ranks])  # fmt: skip
    case, replays = BY_NAME["unequal"], Replays(None, "toy", 2, "toy")
    n = Normalization("rank tokens")
    params = replays.params(case, [n.weights(s) for s in replays.data(case)])
    found = diagnosis.wrong_weights(case, params, right, replays)
    assert describe(n, 2) in [f.words for f in found]


# -- the report -------------------------------------------------------------------------------
def _result(results) -> CheckResult:
    declaration = {"objective": None, "reduction": "token", "constant": None,
                   "count_empty_sequences": False, "equal_counts": False, "stages": [0],
                   "library": "deepspeed", "model": "toy", "world_size": 2}  # fmt: skip
    return CheckResult(declaration, results, 1.0)


def test_the_failure_header_and_its_error_come_from_the_same_case():
    a = CaseResult(0, "equal", Outcome.WRONG_WEIGHTS, 0.02, ["the loop X"])
    b = CaseResult(0, "unequal", Outcome.WRONG_WEIGHTS, 0.30, ["the loop X"])
    text = str(_result([a, b]))
    block = text[text.index("FAIL at stage 0") :]
    assert block.startswith("FAIL at stage 0, case 'unequal'")
    assert "(the same at stage 0 'equal')" in block and "off by up to 30.0% (relative)" in block
    assert BY_NAME["unequal"].describe() in block and "2.0%" not in block


def test_cases_that_need_different_explanations_are_said_to():
    a = CaseResult(0, "holes", Outcome.WRONG_WEIGHTS, 0.04, ["the loop X"], diagnosed_alone=True)
    b = CaseResult(0, "packed", Outcome.WRONG_WEIGHTS, 0.05, [diagnosis.NONE_KNOWN],
                   diagnosed_alone=True)  # fmt: skip
    text = str(_result([a, b]))
    assert text.count("need different explanations") == 1
    assert text.count("diagnosis (this case):") == 2


def test_the_outcomes_are_one_table():
    assert {o.value for o in Outcome} >= {"PASS", "wrong weights", "hang", "loop raised"}
    assert "raised" not in {o.value for o in Outcome}
    assert json.loads(json.dumps({"o": Outcome.HANG})) == {"o": "hang"}


def _documented_fields() -> set[str]:
    """The field names report.py's docstring gives for the JSON."""
    return set(re.findall(r"``(\w+)``", report.__doc__))


# -- bad usage ----------------------------------------------------------------------------------
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
        ([f"{LOOPS}:right_token", "--world-size", "5"], "--world-size 5"),
        ([f"{LOOPS}:right_token", "--case-timeout", "0"], "--case-timeout 0"),
        ([f"{LOOPS}:right_token", "--cases", "equal,no such"], "--cases ['equal', 'no such']"),
        ([f"{LOOPS}:right_token", "--model", "gpt"], "--model 'gpt'"),
        ([f"{LOOPS}:right_token", "--objective", f"{LOOPS}:objective_wrong_shape"],
         "--objective"),
        ([f"{LOOPS}:right_token", "--objective", f"{LOOPS}:no_such"], "--objective"),
        ([f"{LOOPS}:right_token", "--reduction", "token", "--objective", f"{LOOPS}:x"],
         "--objective"),
    ],
)  # fmt: skip
def test_bad_usage_is_one_line_naming_the_argument_and_exit_2(argv, names, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err and err.startswith("gas_lab.check: error: ")


def test_an_objective_of_the_wrong_shape_is_named_with_its_shapes(capsys):
    main([f"{LOOPS}:right_token", "--objective", f"{LOOPS}:objective_wrong_shape"])
    err = capsys.readouterr().err
    assert "rank 0, micro-batch 0: weights [2], want the labels' shape [2, 10]" in err


# -- on the session's ranks -------------------------------------------------------------------
@pytest.mark.ranks
def test_the_readme_snippet_runs_as_written(cluster, tmp_path, monkeypatch):
    """The pytest test the README gives practitioners, extracted from README.md and run with a
    right loop as ``my_trainer.train_step``: the default check, stages 0-2, DeepSpeed."""
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(# tests/test_loss_normalization.py\n.*?)```", readme, re.S)
    assert snippet, "README.md: the pytest snippet for CI is missing"
    (tmp_path / "my_trainer.py").write_text(
        f"import sys\nsys.path.insert(0, {str(LOOPS.parent)!r})\n"
        "from check_loops import right_token as train_step\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace = {}
    exec(compile(snippet.group(1), "README.md", "exec"), namespace)
    tests = [v for k, v in namespace.items() if k.startswith("test_")]
    assert len(tests) == 1
    tests[0]()  # start_cluster() inside check_loop finds the session's 2 ranks


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("fn", "how"),
    [
        ("right_sequence", {"reduction": "sequence", "library": "gas_lab"}),
        ("hf_token_num_items", {"model": "hf"}),
        ("hf_microbatch_mean", {"reduction": "microbatch-mean", "model": "hf",
                                "library": "gas_lab"}),
    ],
)  # fmt: skip
def test_right_loops_pass_at_stages_0_to_2_on_both_libraries_and_models(cluster, fn, how):
    result = check_loop(getattr(check_loops, fn), cluster=cluster, progress=False, **how)
    assert result.ok, str(result)
    assert len(result.results) == len(CASES) * len(result.stages)


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("fn", "how"),
    [
        ("right_token_kwargs", {}),  # engine(**micro_batch) on the toy: a tensor
        ("right_token_loss_mask", {}),  # the loss mask instead of -100
        ("hf_token_logits", {"model": "hf"}),  # out.logits, shifted by hand
        ("hf_microbatch_mean", {"model": "hf", "reduction": "microbatch-mean"}),  # out.loss
        ("sequence_sums_over_8_loop", {"objective": check_loops.sequence_sums_over_8}),
    ],
)
def test_every_supported_way_of_calling_the_model_passes(cluster, fn, how):
    result = check_loop(getattr(check_loops, fn), stages=(0,), cluster=cluster, progress=False,
                        **how)  # fmt: skip
    assert result.ok, str(result)


@pytest.mark.ranks
def test_both_libraries_give_a_wrong_loop_the_same_verdicts(cluster):
    verdicts = {}
    for library in ("deepspeed", "gas_lab"):
        result = check_loop(
            check_loops.mean_of_means, stages=(1,), cluster=cluster, library=library,
            progress=False,
        )  # fmt: skip
        verdicts[library] = [(r.stage, r.case, r.outcome, r.diagnosis) for r in result.results]
    assert verdicts["deepspeed"] == verdicts["gas_lab"]
    assert any("a mean of micro-batch means" in d for *_, ds in verdicts["gas_lab"] for d in ds)


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("loop", "how", "failing", "says"),
    [
        ("mean_of_means", {}, None,
         "this rank's number of micro-batches (a mean of micro-batch means)"),
        ("own_tokens", {}, None,
         "divides each micro-batch's summed loss by this rank's own labelled tokens"),
        ("no_world_factor", {}, None, "the loop does not multiply by the world size W"),
        ("fixed_denominator", {"reduction": "token-sum/sequences"}, None,
         "by the same number, 8,"),
        ("completion_length", {}, {"holes"}, "every rank's completion lengths"),
        ("empty_micro_batch_as_one", {}, {"empty micro-batch"},
         "a micro-batch with none counted as one token"),
        ("right_token", {"reduction": "sequence"}, None, "computes the 'token' objective"),
        ("right_sequence", {"reduction": "token"}, None, "computes the 'sequence' objective"),
        ("dr_grpo_width", {"reduction": "token-sum/sequences", "constant": 10,
                           "count_empty_sequences": True}, {"lengths"},
         "times the micro-batch's padded length T"),
        ("hf_mean_loss_counts_empty", {"model": "hf", "reduction": "microbatch-mean"},
         {"empty micro-batch"}, "the loop counts micro-batches with no label as micro-batches"),
    ],
)  # fmt: skip
def test_a_wrong_loop_gets_the_diagnosis_of_its_mistake(cluster, loop, how, failing, says):
    result = check_loop(
        getattr(check_loops, loop), stages=(1,), cluster=cluster, progress=False, **how
    )
    assert not result.ok
    assert all(r.outcome == "wrong weights" for r in result.failures())
    if failing is not None:
        assert {r.case for r in result.failures()} == failing
    assert all(says in r.diagnosis[0] for r in result.failures()), str(result)


@pytest.mark.ranks
def test_backward_dividing_by_gas_is_named_first(cluster):
    config = {**default_config(0), "gradient_accumulation_steps": 4}
    for fn, also in ((check_loops.right_token, None),
                     (check_loops.gas_divided, "(a sum of micro-batch means)")):  # fmt: skip
        result = check_loop(fn, stages=(0,), config=config, cluster=cluster, equal_counts=True,
                            progress=False)  # fmt: skip
        assert not result.ok
        for r in result.failures():
            first = r.diagnosis[0]
            assert first.startswith("the loop is divided by gradient_accumulation_steps (4)")
            assert also is None or also in first
            assert all("gradient_accumulation_steps (4)" in d for d in r.diagnosis)


@pytest.mark.ranks
def test_a_loop_right_only_for_equal_counts_gets_that_verdict_by_name(cluster):
    result = check_loop(check_loops.unpadded_token, stages=(1, 2), cluster=cluster,
                        progress=False)  # fmt: skip
    for stage in (1, 2):
        assert result.stage_verdict(stage) == report.RIGHT_FOR_EQUAL_COUNTS
    idle = next(r for r in result.results if r.stage == 1 and r.case == "idle rank")
    assert "runs one zero-weight micro-batch" in idle.diagnosis[0]
    assert check_loop(check_loops.unpadded_token, stages=(2,), cluster=cluster,
                      equal_counts=True, progress=False).ok  # fmt: skip


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
    assert {r.outcome for r in result.results} == {Outcome.NOT_ONE_STEP}


@pytest.mark.ranks
def test_a_user_objective_from_the_command_and_its_json(cluster, capsys):
    """--objective FILE.py:FUNCTION in the command (in this process: the session's ranks); the
    JSON carries the whole declaration and the versions, every field documented."""
    code = main([f"{LOOPS}:sequence_sums_over_8_loop", "--objective",
                 f"{LOOPS}:sequence_sums_over_8", "--stages", "0", "--json",
                 "--cases", "unequal,packed"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["ok"], doc
    d = doc["declaration"]
    assert d["cases"] == ["unequal", "packed"]
    assert [r["case"] for r in doc["results"]] == d["cases"]
    assert d["objective"] == f"{LOOPS}:sequence_sums_over_8" and d["reduction"] is None
    assert (d["world_size"], d["model"], d["library"], d["stages"]) == (2, "toy", "deepspeed", [0])
    assert d["config"]["zero_optimization"]["stage"] == 0 and d["config_given"] is False
    assert d["case_timeout"] == CASE_TIMEOUT_S
    assert set(doc["versions"]) == {"gas_lab", "deepspeed", "torch", "transformers"}
    assert doc["versions"]["deepspeed"] == "0.19.8"
    fields = set(doc) | set(d) | set(doc["versions"]) | set(doc["results"][0])
    assert fields <= _documented_fields(), fields - _documented_fields()


# -- three ranks ------------------------------------------------------------------------------
@pytest.mark.ranks
def test_three_ranks_pass_a_right_loop_and_catch_a_world_size_of_2():
    from gas_lab.runtime.cluster import Cluster

    three = Cluster(3, "gloo").start()  # beside the session's 2 ranks, not instead of them
    try:
        right = check_loop(check_loops.right_token, world_size=3, cluster=three, progress=False)
        assert right.ok and right.declaration["world_size"] == 3, str(right)
        wrong = check_loop(check_loops.world_of_two, stages=(0,), world_size=3, cluster=three,
                           progress=False)  # fmt: skip
        assert not wrong.ok and len(wrong.failures()) == len(CASES)
        assert all(r.diagnosis == ["the loop multiplies by 2, not by the world size W (3): a "
                                   "world size written into the loop"]
                   for r in wrong.failures())  # fmt: skip
    finally:
        three.stop()


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
@pytest.mark.parametrize(("loop", "code"), [("hangs_when_idle", 1)])
def test_the_command_exits_0_or_1_and_leaves_no_process(tmp_path, loop, code):
    """The command in a process of its own, on a loop that hangs when a rank is idle: that case
    alone is stopped within --case-timeout and explained, exit 1, and nothing is left running
    (exit 0 and the JSON of a right loop: test_a_user_objective_from_the_command_and_its_json,
    in this process)."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    timeout = 10
    run = subprocess.run(
        [sys.executable, "-m", "gas_lab.check", f"{LOOPS}:{loop}", "--stages", "0", "--json",
         "--case-timeout", str(timeout)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == code, run.stderr[-3000:]
    doc = json.loads(run.stdout)
    assert doc["ok"] is (code == 0) and doc["declaration"]["stages"] == [0]
    assert doc["declaration"]["case_timeout"] == timeout
    if code:
        hung = [r for r in doc["results"] if r["outcome"] != "PASS"]
        assert [(r["case"], r["outcome"]) for r in hung] == [("idle rank", "hang")]
        assert "every rank must call it" in hung[0]["diagnosis"][0]
        assert doc["seconds"] < timeout + 60
    time.sleep(2)  # the guardian ends what the command started once it is gone
    assert _processes_with_tmpdir(str(tmp_path)) == []
