"""Lesson 07 checkers: solutions pass, untouched stubs are 'todo', classic mistakes fail loudly."""

import importlib.util
from pathlib import Path

import pytest

from gas_lab.exercises.lesson07 import check_global_token_count, check_micro_batch_loss
from gas_lab.exercises.verdict import ExerciseFailed

ROOT = Path(__file__).resolve().parents[1]


def _solutions():
    # solutions/ is not a package on purpose (handed out separately): load it by path
    spec = importlib.util.spec_from_file_location("s07", ROOT / "solutions" / "lesson07.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOL = _solutions()


def _todo(*args):
    raise NotImplementedError


def _assert_failed(verdict, case, *words):
    assert verdict.status == "failed", str(verdict)
    assert f"case '{case}'" in verdict.message, verdict.message
    for word in words:
        assert word in verdict.message, verdict.message
    assert verdict.details and verdict.details[0].startswith("Hint:")
    with pytest.raises(ExerciseFailed):
        verdict.raise_if_failed()


# ---------------------------------------------------------------- exercise 1 (one process)
def test_micro_batch_loss_solution_passes():
    verdict = check_micro_batch_loss(SOL.micro_batch_loss).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 3


def test_micro_batch_loss_todo():
    assert check_micro_batch_loss(_todo).status == "todo"


def test_forgetting_world_size_is_named():
    def no_world(tl, mask, rank_tokens, all_tokens, world_size):
        return (tl * mask).sum() / all_tokens

    verdict = check_micro_batch_loss(no_world)
    _assert_failed(verdict, "2 ranks with very different token counts", "1/2", "AVERAGES")
    assert verdict.cases_passed == 1  # one rank: right by luck


def test_dividing_by_world_size_is_named():
    def divided(tl, mask, rank_tokens, all_tokens, world_size):
        return (tl * mask).sum() / all_tokens / world_size

    _assert_failed(
        check_micro_batch_loss(divided), "2 ranks with very different token counts", "0.25 x"
    )


def test_rank_tokens_is_named_with_its_error():
    def local(tl, mask, rank_tokens, all_tokens, world_size):
        return (tl * mask).sum() / rank_tokens

    verdict = check_micro_batch_loss(local)
    _assert_failed(verdict, "2 ranks with very different token counts", "OWN tokens", "off by")
    off_by = float(verdict.message.split("off by ")[1].split("%")[0])
    assert off_by > 1.0


def test_own_mean_is_named():
    def own_mean(tl, mask, rank_tokens, all_tokens, world_size):
        return (tl * mask).sum() / mask.sum()

    _assert_failed(check_micro_batch_loss(own_mean), "1 rank", "mean of means")


def test_counting_padding_is_named():
    def padding(tl, mask, rank_tokens, all_tokens, world_size):
        return tl.sum() / all_tokens * world_size

    _assert_failed(check_micro_batch_loss(padding), "1 rank", "padding")


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
    assert check_global_token_count(_todo, cluster).status == "todo"


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


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("wrong", "words"),
    [
        (_local_only, "own count: all_reduce"),
        (_padding, "padding counted"),
        (_mean, "keep the SUM"),
    ],
)
def test_global_token_count_mistakes_are_named(cluster, wrong, words):
    verdict = check_global_token_count(wrong, cluster)
    _assert_failed(verdict, "step 3: tokens per rank [111, 12]", words, "expected 123")
