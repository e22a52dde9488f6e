"""DeepSpeed's engine on top of gas_lab's floor: what makes a loop written for
``deepspeed.initialize`` run unchanged on :func:`gas_lab.initialize`, with the same numbers.

* :mod:`~gas_lab.deepspeed_compat.engine`: ``DeepSpeedEngine`` (the floor's ``Engine`` plus
  refusals, hooks, precision, schedules, checkpoints) and ``initialize``.
* :mod:`~gas_lab.deepspeed_compat.config`, :mod:`~gas_lab.deepspeed_compat.keys`,
  :mod:`~gas_lab.deepspeed_compat.optimizers`: DeepSpeed's config, its keys and defaults.
* :mod:`~gas_lab.deepspeed_compat.strategies`, :mod:`~gas_lab.deepspeed_compat.buckets`,
  :mod:`~gas_lab.deepspeed_compat.precision`: the ZeRO strategies as DeepSpeed runs them.
* :mod:`~gas_lab.deepspeed_compat.schedules`, :mod:`~gas_lab.deepspeed_compat.checkpoint`,
  :mod:`~gas_lab.deepspeed_compat.loader`, :mod:`~gas_lab.deepspeed_compat.loss_scaling`: what a
  real loop needs around it (lessons 07 and 08).
"""
