"""Appendix A6's exercise, checked by gas_lab.check itself: the solution passes, the untouched
stub fails as a loop that raised, and wrong sequence loops fail with the mistake named (a packed
row counted as one sequence among them). At stage 0 only (a normalization is the same at every
stage; test_check.py covers the stages)."""

import pytest
import torch.distributed as dist
import torch.nn.functional as F
from exercise_support import load_solutions, todo

from gas_lab.check import cases, check_loop
from gas_lab.lessons.contract_loops import (
    all_ranks,
    document_means,
    document_tokens,
    labelled,
    padded,
    summed,
)

SOL = load_solutions("appendix_a6")


def _diagnoses(result) -> str:
    return " ".join(d for r in result.failures() for d in r.diagnosis)


@pytest.mark.ranks
def test_the_solution_passes(cluster):
    result = check_loop(SOL.sequence_step, "sequence", stages=(0,), cluster=cluster, progress=False)
    assert result.ok and len(result.results) == len(cases.chosen()), str(result)  # stage 0


@pytest.mark.ranks
def test_the_untouched_stub_fails_as_the_loops_own_error(cluster):
    result = check_loop(todo, "sequence", stages=(0,), cluster=cluster, progress=False)
    assert not result.ok
    assert {r.outcome for r in result.results} == {"loop raised"}, str(result)
    assert "NotImplementedError" in str(result)


def _token_weighted(engine, micro_batches):
    """The 'token' objective where 'sequence' is declared."""
    world, tokens = dist.get_world_size(), all_ranks(labelled(micro_batches))
    for mb, weight in padded(micro_batches):
        engine.backward(summed(engine, mb) * world / tokens * weight, scale_wrt_gas=False)
    engine.step()


def _own_sequences(engine, micro_batches):
    """Each rank divides by its own documents with a label."""
    mine = max(sum(int((document_tokens(mb) > 0).sum()) for mb in micro_batches), 1)
    for mb, weight in padded(micro_batches):
        engine.backward(document_means(engine, mb).sum() / mine * weight, scale_wrt_gas=False)
    engine.step()


def _rows(engine, micro_batches):
    """Rows for documents: a packed row's documents share one mean and count as one."""
    world = dist.get_world_size()
    rows = all_ranks(sum(int(((mb["labels"] != -100).sum(1) > 0).sum()) for mb in micro_batches))
    for mb, weight in padded(micro_batches):
        ce = F.cross_entropy(
            engine(mb["input_ids"]).transpose(1, 2),
            mb["labels"],
            ignore_index=-100,
            reduction="none",
        )
        means = ce.sum(1) / (mb["labels"] != -100).sum(1).clamp(min=1)
        engine.backward(means.sum() * world / rows * weight, scale_wrt_gas=False)
    engine.step()


@pytest.mark.ranks
@pytest.mark.parametrize(
    "fn, named, where",
    [
        (_token_weighted, "the loop computes the 'token' objective, not the one declared", None),
        (
            _own_sequences,
            "this rank's own number of sequences, each token by its sequence's tokens",
            None,
        ),
        (_rows, "a packed row counted as one sequence", {"packed"}),
    ],
)
def test_wrong_sequence_loops_fail_with_the_mistake_named(cluster, fn, named, where):
    result = check_loop(fn, "sequence", stages=(0,), cluster=cluster, progress=False)
    assert not result.ok and named in _diagnoses(result), str(result)
    if where is not None:  # the mistake shows in these cases only
        assert {r.case for r in result.failures()} == where, str(result)
