"""Appendix A2's checker: the solution passes, the untouched stub is 'todo', typical mistakes
fail with what differs (the fix held back for a second try); and the checker's reference is
what DeepSpeed's optimizer receives on 2 real ranks, bit for bit."""

import pytest
import torch
from exercise_support import (
    assert_failed,
    assert_hint_on_second_try,
    assert_todo,
    first_try,
    load_solutions,
    reset_tries,
    todo,
)

from gas_lab.lessons.exercises.appendix_a2 import check_optimizer_gradient, reference

SOL = load_solutions("appendix_a2")
DEFAULT = "accumulate bf16, all-reduce bf16 (the default), N = 16"
BF16_OPTIMIZER = "accumulate fp32, all-reduce bf16 (BF16_Optimizer's default), N = 16"


def test_solution_passes():
    verdict = check_optimizer_gradient(SOL.optimizer_gradient).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 4


def test_todo():
    assert_todo(check_optimizer_gradient(todo))


def always_fp32(micro_grads, accumulate, communicate):
    return SOL.optimizer_gradient(micro_grads, torch.float32, communicate)


def no_communication_cast(micro_grads, accumulate, communicate):
    return SOL.optimizer_gradient(micro_grads, accumulate, accumulate)


def exact(micro_grads, accumulate, communicate):
    return (sum(g.double() for grads in micro_grads for g in grads) / len(micro_grads)).float()


def no_mean(micro_grads, accumulate, communicate):
    return SOL.optimizer_gradient(micro_grads, accumulate, communicate) * len(micro_grads)


@pytest.mark.parametrize(
    "wrong, case, hint_words",
    [
        (always_fp32, DEFAULT, ["must add up in `accumulate`"]),
        (no_communication_cast, BF16_OPTIMIZER, ["runs in `communicate`"]),
        (exact, DEFAULT, ["rounds where the config says"]),
        (no_mean, DEFAULT, ["divides the ranks' sum"]),
    ],
    ids=["accumulates in fp32 always", "no bf16 all-reduce", "no rounding", "the sum"],
)
def test_typical_mistakes_say_what_differs_then_hint(wrong, case, hint_words):
    verdict = first_try(check_optimizer_gradient, wrong)
    assert_failed(verdict, case, "elements differ", "relative error against the exact mean")
    reset_tries()
    assert_hint_on_second_try(lambda: check_optimizer_gradient(wrong), *hint_words)


def test_a_bf16_result_is_told_the_dtype():
    def in_bf16(micro_grads, accumulate, communicate):
        return SOL.optimizer_gradient(micro_grads, accumulate, communicate).bfloat16()

    assert_failed(first_try(check_optimizer_gradient, in_bf16), DEFAULT, "returned bfloat16")


# ---------------------------------------------------------------- the reference is DeepSpeed's
def _deepspeed_and_reference(cells, n):
    import torch.distributed as dist

    from gas_lab.measure import bf16_gradients, replay

    mine = bf16_gradients.micro_gradients(n)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = []
    for cfg, accumulate, communicate in cells:
        cfg = {**cfg, "gradient_accumulation_steps": n}
        out.append({"ours": reference(every, accumulate, communicate),
                    **replay.both(bf16_gradients.boundary_gradient, cfg, n)})  # fmt: skip
    return out


@pytest.mark.ranks
def test_the_reference_is_what_deepspeeds_optimizer_receives(cluster):
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "bf16": {"enabled": True}}  # fmt: skip
    bf16, fp32 = torch.bfloat16, torch.float32
    accum = {"data_types": {"grad_accum_dtype": "fp32"}}
    cells = [
        ({**base, "zero_optimization": {"stage": 0}}, bf16, bf16),
        ({**base, "zero_optimization": {"stage": 1}}, bf16, bf16),
        ({**base, "zero_optimization": {"stage": 1}, **accum}, fp32, bf16),
        ({**base, "zero_optimization": {"stage": 1}, **accum, "communication_data_type": "fp32"},
         fp32, fp32),
    ]  # fmt: skip
    for rank in cluster.run(_deepspeed_and_reference, cells, 16, timeout=300):
        for out in rank:
            deepspeed, gas_lab = out["deepspeed"]["gradient"], out["gas_lab"]["gradient"]
            assert torch.equal(out["ours"].double(), deepspeed)
            assert torch.equal(gas_lab, deepspeed)
