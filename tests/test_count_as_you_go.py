"""Appendix A6's answer for loops that learn the step's count only after the last backward()
(gas_lab/lessons/contract_loops.py), each claim held by gas_lab.check on real DeepSpeed: the
count taken before the first backward() passes at stages 0-2; DeepSpeed's public gradient
accessors scale the gradients at stages 0 and 1 and refuse at stage 2; the optimizer's private
loss scale passes at stages 1 and 2, is absent at stage 0, and breaks a second step unless it is
set back to 1. (A6 shows the stage-2 refusal on one backward() per rank, in a fraction of a
second; here the checker runs it, each case ending in a restart of the ranks.)"""

import pytest

from gas_lab.check import check_loop
from gas_lab.check.cases import CASES
from gas_lab.lessons import contract_loops as loops

REFUSED = "Gradients are only available immediately after backward and before engine step"


def _check(fn, stages, cluster, **how):
    return check_loop(fn, "token", stages=stages, cluster=cluster, progress=False, **how)


@pytest.mark.ranks
def test_counting_first_passes_at_every_stage(cluster):
    result = _check(loops.token_step, (0, 1, 2), cluster)
    assert result.ok, str(result)


@pytest.mark.ranks
def test_the_public_accessors_scale_the_gradients_at_stages_0_and_1(cluster):
    result = _check(loops.scale_grads, (0, 1), cluster)
    assert result.ok, str(result)


@pytest.mark.ranks
def test_the_public_accessors_refuse_at_stage_2(cluster):
    # One case: the refusal comes at the first backward() of any case, and each refusal restarts
    # the ranks (the others wait for it in the accessor's own all-reduce).
    result = _check(loops.scale_grads, (2,), cluster, cases=("equal",))
    assert result.results and not any(r.passed for r in result.results), str(result)
    assert all(REFUSED in r.detail for r in result.results), str(result)


@pytest.mark.ranks
def test_the_private_loss_scale_passes_at_stages_1_and_2_and_is_absent_at_0(cluster):
    result = _check(loops.loss_scale_hack, (0, 1, 2), cluster)
    assert [result.stage_verdict(s) for s in (1, 2)] == ["PASS", "PASS"], str(result)
    at_0 = [r for r in result.results if r.stage == 0]
    assert at_0 and all("has no attribute 'loss_scaler'" in r.detail for r in at_0), str(result)


@pytest.mark.ranks
def test_the_private_loss_scale_not_set_back_breaks_the_second_step(cluster):
    result = _check(loops.loss_scale_hack_without_reset, (1,), cluster)
    several = {c.name for c in CASES if len(c.steps) > 1}
    assert several and {r.case for r in result.failures()} == several, str(result)
