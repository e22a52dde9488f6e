"""Lesson 00 checker: the solution passes, the TODO stub is 'todo', a sum instead of a mean fails."""

import importlib.util
from pathlib import Path

import pytest

from gas_lab.exercises.lesson00 import check_mean_across_ranks

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.ranks


def _solution():
    spec = importlib.util.spec_from_file_location("s00", ROOT / "solutions" / "lesson00.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.mean_across_ranks


def _todo(x):
    raise NotImplementedError


def _sum_instead_of_mean(x):
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def test_solution_passes(cluster):
    check_mean_across_ranks(_solution(), cluster).raise_if_failed()


def test_untouched_todo_is_reported_not_raised(cluster):
    assert check_mean_across_ranks(_todo, cluster).status == "todo"


def test_sum_instead_of_mean_fails_with_a_precise_message(cluster):
    verdict = check_mean_across_ranks(_sum_instead_of_mean, cluster)
    assert verdict.status == "failed"
    assert "case 'one number per rank'" in verdict.message
    assert "that is the sum: divide by the world size" in verdict.message
