"""Appendix A6's exercise, checked by gas_lab.check itself: the solution passes, the untouched
stub fails as a loop that raised, and wrong sequence loops fail with the mistake named. At
stage 0 only (a normalization is the same at every stage; test_check.py covers the stages)."""

import pytest
import torch
import torch.distributed as dist
from exercise_support import load_solutions, todo

from gas_lab.check import check_loop
from gas_lab.check.cases import CASES

SOL = load_solutions("appendix_a6")


def _diagnoses(result) -> str:
    return " ".join(d for r in result.failures() for d in r.diagnosis)


@pytest.mark.ranks
def test_the_solution_passes(cluster):
    result = check_loop(SOL.sequence_step, "sequence", stages=(0,), cluster=cluster, progress=False)
    assert result.ok and len(result.results) == len(CASES), str(result)


@pytest.mark.ranks
def test_the_untouched_stub_fails_as_the_loops_own_error(cluster):
    result = check_loop(todo, "sequence", stages=(0,), cluster=cluster, progress=False)
    assert not result.ok
    assert {r.outcome for r in result.results} == {"loop raised"}, str(result)
    assert "NotImplementedError" in str(result)


def _token_weighted(engine, micro_batches):
    """The 'token' objective where 'sequence' is declared."""
    world = dist.get_world_size()
    tokens = SOL.all_ranks(sum(int((mb["labels"] != -100).sum()) for mb in micro_batches))
    busiest = int(SOL.all_ranks(len(micro_batches), dist.ReduceOp.MAX))
    for i in range(busiest):
        mb, weight = (micro_batches[i], 1.0) if i < len(micro_batches) else (SOL.FILLER, 0.0)
        logits = engine(mb["input_ids"])
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100, reduction="sum"
        )
        engine.backward(ce * world / tokens * weight, scale_wrt_gas=False)
    engine.step()


def _own_sequences(engine, micro_batches):
    """Each rank divides by its own sequences with a label."""
    mine = max(sum(int(((mb["labels"] != -100).sum(1) > 0).sum()) for mb in micro_batches), 1)
    busiest = int(SOL.all_ranks(len(micro_batches), dist.ReduceOp.MAX))
    for i in range(busiest):
        mb, weight = (micro_batches[i], 1.0) if i < len(micro_batches) else (SOL.FILLER, 0.0)
        engine.backward(SOL.sequence_means(engine, mb).sum() / mine * weight, scale_wrt_gas=False)
    engine.step()


@pytest.mark.ranks
@pytest.mark.parametrize(
    "fn, named",
    [
        (_token_weighted, "the loop computes the 'token' objective, not the one declared"),
        (
            _own_sequences,
            "this rank's own number of sequences, each token by its sequence's tokens",
        ),
    ],
)
def test_wrong_sequence_loops_fail_with_the_mistake_named(cluster, fn, named):
    result = check_loop(fn, "sequence", stages=(0,), cluster=cluster, progress=False)
    assert not result.ok and named in _diagnoses(result), str(result)
