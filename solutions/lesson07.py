"""Reference solutions for lesson 07's exercises (tutorials/07_capstone.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other.
``python solutions/lesson07.py`` starts 2 CPU ranks and shows both checkers pass.
"""

from __future__ import annotations


def sequence_mean_loss(token_losses, mask, rank_sequences, all_sequences, all_tokens, world_size):
    """Exercise 1: the sequence-level mean over every sequence of every rank."""
    # Each sequence: the mean of its real tokens' losses, so a long one weighs what a short one
    # does. Then every sequence of the step weighs 1 / all_sequences, and x world_size undoes
    # DeepSpeed's average over ranks. rank_sequences and all_tokens are traps here.
    per_sequence = (token_losses * mask).sum(1) / mask.sum(1)
    return per_sequence.sum() / all_sequences * world_size


class Trainer:
    """Exercise 2: ``CachedCountTrainer`` fixed."""

    def __init__(self, engine):
        import torch.distributed as dist

        self.engine = engine
        self.world = dist.get_world_size()

    def train_step(self, micro_batches):
        from gas_lab.accumulate import token_losses
        from gas_lab.dp import global_count

        # The bug: the count was all-reduced once, at step 0, and reused. Every step has its
        # own rollouts, so its own count: one all-reduce per step, before the first backward.
        tokens = global_count(sum(int(mb.mask.sum()) for mb in micro_batches))
        for mb in micro_batches:
            loss = (token_losses(self.engine, mb) * mb.mask).sum() / tokens * self.world
            self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises.lesson07 import check_sequence_mean_loss, check_trainer

    print(check_sequence_mean_loss(sequence_mean_loss))
    cluster = gas_lab.start_cluster(world_size=2, device="cpu")
    print(check_trainer(Trainer, cluster))
    cluster.stop()
