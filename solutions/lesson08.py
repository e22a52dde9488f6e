"""Reference solutions for lesson 08's exercises (tutorials/08_edges.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other.
"""

from __future__ import annotations


def sum_loss(token_losses, mask, rank_tokens, all_tokens, world_size, gas):
    """Exercise 1: the loss for engine.backward(loss) with "gradient_allreduce_op": "sum"."""
    # Every real token of the step weighs 1 / all_tokens. The sum all-reduce adds the ranks'
    # gradients (no division by world_size to undo); backward() divides by gas, so undo that.
    return (token_losses * mask).sum() / all_tokens * gas


def resume_position(global_steps, micro_batches_per_step):
    """Exercise 2: the first micro-batch to run after load_checkpoint."""
    # The weights hold every micro-batch of the first global_steps steps and nothing of the
    # open window (gradients are not saved): redo that window from its first micro-batch.
    return sum(micro_batches_per_step[:global_steps])


def token_count(engine, tokens_per_update):
    """Exercise 3: the token count to continue the token clock from after load_checkpoint."""
    # The checkpoint restored the scheduler, whose counter is the clock's last value,
    # tokens_so_far / tokens_per_update - 1: invert it. (A loop that saves the count in
    # save_checkpoint's client_state gets it back from load_checkpoint just as well.)
    return (engine.lr_scheduler.last_batch_iteration + 1) * tokens_per_update


if __name__ == "__main__":
    from gas_lab.lessons.exercises.lesson08 import (
        check_resume_position,
        check_sum_loss,
        check_token_count,
    )

    print(check_sum_loss(sum_loss))
    print(check_resume_position(resume_position))
    print(check_token_count(token_count))
