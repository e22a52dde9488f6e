"""Solutions to lesson 06's exercises (for instructors; handed out after the workshop).

Both are measured on DeepSpeed on the ranks: ``python solutions/lesson06.py`` starts 2 CPU
ranks and shows both checkers pass.
"""

from gas_lab.rules.refusals import Example, Rule


def my_predictions() -> dict:
    return {
        "A": "initialize",  # unmanaged + overlap_comm at stage 1, whatever offload or bf16
        "B": "step",  # step() inside no_sync(): refused in managed mode too, at ZeRO-1 too
        "C": "accepted",  # no_sync() unmanaged at stage 0/1: backward() accumulates anyway
        "D": "accepted",  # managed: overriding the counter's boundary is allowed
        "E": "accepted",  # loss.backward() is refused at stage 0 only
        "F": "accepted",  # managed ZeRO-1: what coalesce_grad_reduction() is for
        "G": "coalesce_grad_reduction",  # unmanaged, any stage, on entering the block
        "H": "no_sync",  # ZeRO-2 reduces in every backward(): no_sync() refused in both modes
    }


def zero_pipeline_rule() -> Rule:
    return Rule(
        name="pipeline_zero23",
        action="initialize",
        moment="initialize",
        keys=("PipelineModule", "zero_optimization.stage>=2"),
        condition="a pipeline-parallel model with ZeRO stage 2 or 3",
        reason="The pipeline engine runs its own schedule of micro-batch backward passes; "
        "ZeRO-2/3 reduce-scatter (and free) every gradient inside each backward, which that "
        "schedule does not drive.",
        prevents="gradient partitions reduced on a schedule the pipeline never follows.",
        deepspeed_raises="AssertionError",  # measured with lesson06.measure_live
        deepspeed_message="ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism",
        example=Example(config={"zero_optimization": {"stage": 2}}, pipeline=True),
        # Unmanaged, DeepSpeed's own "no pipelines unmanaged" check fires first (measured):
        # the known rule comes first in the list, so this one may stay this simple.
        applies=lambda s: s.pipeline and s.config.zero_optimization.stage >= 2,
    )


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises.lesson06 import check_new_rule, check_predictions

    cluster = gas_lab.start_cluster(world_size=2, device="cpu")
    print(check_predictions(my_predictions, cluster))
    print(check_new_rule(zero_pipeline_rule, cluster))
    cluster.stop()
