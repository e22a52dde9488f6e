"""Lesson 04 checkers: solutions pass, untouched stubs are 'todo', typical mistakes are named."""

import pytest
from exercise_support import (
    assert_failed,
    assert_hint_on_second_try,
    assert_todo,
    first_try,
    load_solutions,
    reset_tries,
    todo,
)

from gas_lab.lessons.exercises.lesson04 import (
    check_rpc_step,
    check_sample_weights,
    hanging_step,
)

SOL = load_solutions(4)
pytestmark = pytest.mark.ranks


@pytest.mark.parametrize(
    ("check", "solution"),
    [(check_sample_weights, SOL.sample_weighted_losses), (check_rpc_step, SOL.rpc_step)],
)
def test_solutions_pass_and_stubs_are_todo(cluster, check, solution):
    verdict = check(solution, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 3
    assert_todo(check(todo, cluster))


# ---------------------------------------------------------------- exercise 1
def _lessons_divisor(losses):  # lesson 04's global_n: right for micro-batches, not samples
    import torch.distributed as dist

    from gas_lab.dp import global_count

    divisor = global_count(len(losses)) / dist.get_world_size()
    return [x.mean() / divisor for x in losses]


def _own_samples(losses):
    samples = sum(len(x) for x in losses)
    return [x.sum() / samples for x in losses]


def _no_world_size(losses):
    from gas_lab.dp import global_count

    samples = global_count(sum(len(x) for x in losses))
    return [x.sum() / samples for x in losses]


@pytest.mark.parametrize(
    ("wrong", "case", "differs", "fix"),
    [
        (_lessons_divisor, "a ragged last micro-batch", ["every MICRO-BATCH the same"],
         ["count this rank's samples"]),
        (_own_samples, "a ragged last micro-batch", ["every RANK the same"], ["global_count()"]),
        (_no_world_size, "equal micro-batches, same count on every rank", ["2x too small"],
         ["divides by the world size"]),
    ],
)  # fmt: skip
def test_sample_weight_mistakes_say_what_differs_then_the_fix(cluster, wrong, case, differs, fix):
    verdict = first_try(check_sample_weights, wrong, cluster)
    assert_failed(verdict, case, *differs)
    assert "Look again at: *Pitfall 2" in str(verdict)
    reset_tries()
    assert_hint_on_second_try(lambda: check_sample_weights(wrong, cluster), *fix)


def test_wrong_number_of_losses_is_reported(cluster):
    verdict = check_sample_weights(lambda losses: losses[:1], cluster)
    assert verdict.status == "failed" and "one loss per micro-batch" in verdict.message


# ---------------------------------------------------------------- exercise 2
def _count_moved_but_step_skipped(engine, micro_batches, loss_fn):
    import torch.distributed as dist

    from gas_lab.dp import global_count

    divisor = global_count(len(micro_batches)) / dist.get_world_size()
    for x, y in micro_batches:
        engine.backward(loss_fn(engine(x), y) / divisor, scale_wrt_gas=False)
    if micro_batches:
        engine.step()


def test_the_given_handler_fails_fast_on_its_count(cluster):
    verdict = first_try(check_rpc_step, hanging_step, cluster)
    assert_failed(verdict, "same N on every rank", "all-reduced the count 2 times in step 0")
    assert verdict.cases_passed == 0
    assert "count once per step, before the loop" in verdict.hint()


def test_a_rank_skipping_step_hangs_and_is_explained(cluster):
    verdict = first_try(check_rpc_step, _count_moved_but_step_skipped, cluster)
    assert_failed(verdict, "a rank with nothing to do", "the ranks hung")
    assert verdict.cases_passed == 2
    assert "same collectives" in verdict.hint() and "step() included" in verdict.hint()
    assert cluster.run(lambda: 1) == [1, 1]  # restarted and usable
