"""Reference solutions for lesson 03's exercises (tutorials/03_managed.ipynb).

Run ``python solutions/lesson03.py`` to see every checker pass (one process, no ranks needed).
"""

from __future__ import annotations


def boundary_steps(gas, calls):
    """Exercise 1: the k-th step() call (from 1) updates when k is a multiple of GAS."""
    # The engine tests (micro_steps + 1) % gas with micro_steps = k - 1 calls already made.
    return [k % gas == 0 for k in range(1, calls + 1)]


def managed_loop(engine, micro_batches, loss_fn):
    """Exercise 2: the symmetric loop; the engine divides by GAS and decides when to update."""
    for x, y in micro_batches:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()


def variable_window(engine, micro_batches, loss_fn):
    """Exercise 3: one update over N micro-batches, N not necessarily GAS."""
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        engine.set_gradient_accumulation_boundary(i == n - 1)  # only the last one reduces
        # The engine would divide by GAS; the window has N micro-batches, so divide by N.
        engine.backward(loss_fn(engine(x), y) / n, scale_wrt_gas=False)
    engine.step()


if __name__ == "__main__":
    from gas_lab.lessons.exercises.lesson03 import (
        check_boundary_steps,
        check_managed_loop,
        check_variable_window,
    )

    print(check_boundary_steps(boundary_steps))
    print(check_managed_loop(managed_loop))
    print(check_variable_window(variable_window))
