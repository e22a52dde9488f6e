"""The rules of unmanaged accumulation, with their teaching aids (lesson 06).

* :mod:`~gas_lab.rules.calls`: the engine's calls, named once (the ops of the matrix, the call
  a rule checks, a learner's label, how to perform it).
* :mod:`~gas_lab.rules.refusals`: the combinations DeepSpeed refuses, as data, and
  :func:`~gas_lab.rules.refusals.enforce`, which the engine calls.
* :mod:`~gas_lab.rules.traps`: combinations DeepSpeed accepts that still train wrong.
* :mod:`~gas_lab.rules.prediction`: what DeepSpeed does with a config, from the rules alone.
* :mod:`~gas_lab.rules.matrix`: measuring DeepSpeed's accept/refuse matrix
  (``python -m gas_lab.rules.matrix``).
* :mod:`~gas_lab.rules.unsafe`: rules switched off, to measure what each one prevents.
"""
