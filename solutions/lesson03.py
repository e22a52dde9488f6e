"""Reference solutions for lesson 03's exercises (tutorials/03_managed.ipynb).

Exercise 1 is measured on DeepSpeed on the ranks: ``python solutions/lesson03.py`` starts 2 CPU
ranks and shows both checkers pass.
"""

from __future__ import annotations


def counter_predictions():
    """Exercise 1: (micro_steps, global_steps, global_samples) after each script, 2 ranks,
    micro-batch 2, so every update adds 2 x GAS x 2 = 16 samples (GAS 4)."""
    return {
        "A": (10, 2, 32),  # boundaries at calls 4 and 8; calls 9 and 10 wait for the 12th
        "B": (8, 2, 32),  # True: call 4 updates; None: the counter (at 4) updates at call 8
        "C": (8, 1, 16),  # False holds back call 4; call 8 updates once, from 8 micro-batches
        "D": (1, 0, 0),  # one step() call is one micro-step: no update at all
        "E": (8, 2, 32),  # every step() counts: calls 4 and 8 are the boundaries
    }


def train_epochs(engine, epochs, loss_fn):
    """Exercise 2: one update per GAS micro-batches, and one per epoch's remainder."""
    gas = engine.gradient_accumulation_steps()
    for micro_batches in epochs:
        for start in range(0, len(micro_batches), gas):
            window = micro_batches[start : start + gas]  # the last one may be short
            n = len(window)
            for i, (x, y) in enumerate(window):
                # Every boundary decided here, so the counter's phase never matters; and the
                # engine would divide by GAS, while this window has n micro-batches.
                engine.set_gradient_accumulation_boundary(i == n - 1)
                engine.backward(loss_fn(engine(x), y) / n, scale_wrt_gas=False)
            engine.step()
    engine.set_gradient_accumulation_boundary(None)  # leave the counter in charge again


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises.lesson03 import check_counter_predictions, check_epochs

    print(check_epochs(train_epochs))
    cluster = gas_lab.start_cluster(world_size=2, device="cpu")
    print(check_counter_predictions(counter_predictions, cluster))
    cluster.stop()
