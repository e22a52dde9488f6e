"""Lesson 07 checkers: solutions pass, untouched stubs are 'todo', classic mistakes fail loudly."""

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo

from gas_lab.lessons.exercises.lesson07 import check_global_token_count, check_micro_batch_loss

SOL = load_solutions(7)


# ---------------------------------------------------------------- exercise 1 (one process)
def test_micro_batch_loss_solution_passes():
    verdict = check_micro_batch_loss(SOL.micro_batch_loss).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 3


def test_micro_batch_loss_todo():
    assert_todo(check_micro_batch_loss(todo))


def test_forgetting_world_size_is_named():
    def no_world(tl, mask, rank_tokens, all_tokens, world_size):
        return (tl * mask).sum() / all_tokens

    verdict = check_micro_batch_loss(no_world)
    assert_failed(verdict, "2 ranks with very different token counts", "1/2", "AVERAGES")
    assert verdict.cases_passed == 1  # one rank: right by luck


def test_dividing_by_world_size_is_named():
    def divided(tl, mask, rank_tokens, all_tokens, world_size):
        return (tl * mask).sum() / all_tokens / world_size

    assert_failed(
        check_micro_batch_loss(divided), "2 ranks with very different token counts", "0.25 x"
    )


def test_rank_tokens_is_named_with_its_error():
    def local(tl, mask, rank_tokens, all_tokens, world_size):
        return (tl * mask).sum() / rank_tokens

    verdict = check_micro_batch_loss(local)
    assert_failed(verdict, "2 ranks with very different token counts", "OWN tokens", "off by")
    off_by = float(verdict.message.split("off by ")[1].split("%")[0])
    assert off_by > 1.0


def test_own_mean_is_named():
    def own_mean(tl, mask, rank_tokens, all_tokens, world_size):
        return (tl * mask).sum() / mask.sum()

    assert_failed(check_micro_batch_loss(own_mean), "1 rank", "mean of means")


def test_counting_padding_is_named():
    def padding(tl, mask, rank_tokens, all_tokens, world_size):
        return tl.sum() / all_tokens * world_size

    assert_failed(check_micro_batch_loss(padding), "1 rank", "padding")


def test_detached_loss_is_reported():
    def detached(tl, mask, rank_tokens, all_tokens, world_size):
        return SOL.micro_batch_loss(tl, mask, rank_tokens, all_tokens, world_size).detach()

    verdict = check_micro_batch_loss(detached)
    assert verdict.status == "failed" and "no gradient" in verdict.message


# ---------------------------------------------------------------- exercise 2 (on the ranks)
@pytest.mark.ranks
def test_global_token_count_solution_passes(cluster):
    verdict = check_global_token_count(SOL.global_token_count, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 2


@pytest.mark.ranks
def test_global_token_count_todo(cluster):
    assert_todo(check_global_token_count(todo, cluster))


def _local_only(masks):
    return sum(int(m.sum()) for m in masks)


def _padding(masks):
    import torch
    import torch.distributed as dist

    total = torch.tensor([sum(m.numel() for m in masks)])
    dist.all_reduce(total)
    return total.item()


def _mean(masks):
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(sum(m.sum() for m in masks))])
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _forgot_return(masks):
    import torch
    import torch.distributed as dist

    total = torch.tensor([sum(int(m.sum()) for m in masks)])
    dist.all_reduce(total)


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("wrong", "words"),
    [
        (_local_only, "own count: all_reduce"),
        (_padding, "padding counted"),
        (_mean, "keep the SUM"),
        (_forgot_return, "returned None"),
    ],
)
def test_global_token_count_mistakes_are_named(cluster, wrong, words):
    verdict = check_global_token_count(wrong, cluster)
    assert_failed(verdict, "step 3: tokens per rank [111, 12]", words, "expected 123")
