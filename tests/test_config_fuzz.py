"""Fuzzing ``gas_lab.initialize`` with malformed configs (tests/config_fuzz.py): every refusal
names the key and is gas_lab's own error; what is accepted trains a step and is kept as given.
One process, no ranks, a fixed seed (about ten seconds).

What DeepSpeed does with the accepted cases is measured by ``python tests/config_fuzz.py
--deepspeed`` (minutes); the ones it refuses or crashes on became refusals here.
"""

import math
import os

import pytest
from config_fuzz import sample

os.environ.setdefault("DS_ACCELERATOR", "cpu")

SEED, N = 0, 600


@pytest.fixture(scope="module")
def outcomes():
    import warnings

    from config_fuzz import outcome

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [(case, *outcome(case)) for case in sample(SEED, N)]


def test_the_sample_covers_every_kind_of_key(outcomes):
    keys = {case.path[:2] for case, _, _ in outcomes}
    assert len(outcomes) == N and len(keys) > 40
    kinds = {kind for _, kind, _ in outcomes}
    assert kinds == {"clear", "accepted"}, "nothing unclear, and both other outcomes occur"


def test_every_refusal_names_the_key(outcomes):
    unclear = [(case.key, case.value, message) for case, kind, message in outcomes
               if kind == "unclear"]  # fmt: skip
    assert unclear == []


def _at(tree, path):
    for part in path:
        tree = tree[part]
    return tree


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b and type(a) is type(b) or (type(a), type(b)) in ((int, float), (float, int))


# A null here means "leave it out" in DeepSpeed too: the default (or the derived batch number).
NULL_IS_ABSENT = {"train_batch_size", "gradient_accumulation_steps", "steps_per_print",
                  "communication_data_type", "overlap_comm", "grad_accum_dtype", "scheduler",
                  "torch_adam", "adam_w_mode", "amsgrad", "nesterov", "foreach"}  # fmt: skip


def test_accepted_values_are_kept_as_given(outcomes):
    """No silent coercion: an accepted leaf value is the value gas_lab then holds (the issue
    found ``reduce_bucket_size: true``, ``"2"`` and 1e30 accepted and never read)."""
    from gas_lab.deepspeed_compat.config import load_config

    checked = 0
    for case, kind, _ in outcomes:
        if kind != "accepted" or isinstance(case.value, dict):
            continue
        if case.value is None and case.path[-1] in NULL_IS_ABSENT:
            continue
        cfg = load_config(case.config())
        in_params = len(case.path) == 3 and case.path[:2] == ("optimizer", "params")
        held = cfg.optimizer.params if in_params else None
        if held is not None:
            assert _same(held[case.path[-1]], case.value), case
        else:
            assert _same(_at(cfg.model_dump(), case.path), case.value), case
        checked += 1
    assert checked > 20
