"""The rules of unmanaged accumulation, as data (lesson 06), read by the DeepSpeed engine.

* :mod:`~gas_lab.rules.operations`: the engine's calls, named once (the ops of the matrix, the
  call a rule checks, a learner's label, how to perform it).
* :mod:`~gas_lab.rules.refusals`: the combinations DeepSpeed refuses, as data, and
  :func:`~gas_lab.rules.refusals.enforce`, which the engine calls.
* :mod:`~gas_lab.rules.traps`: combinations DeepSpeed accepts that still train wrong.

What runs configs to measure them (the matrix, predictions, the unsafe teaching mode) lives
with the other measurements, in :mod:`gas_lab.measure`.
"""
