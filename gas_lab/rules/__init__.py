"""The rules of unmanaged accumulation, as data (lesson 06), read by the DeepSpeed engine.

* :mod:`~gas_lab.rules.operations`: the engine's calls, named once (the ops of the matrix, the
  call a rule checks, a learner's label, how to perform it).
* :mod:`~gas_lab.rules.refusals`: the combinations DeepSpeed refuses, gathered in the order it
  checks them, and :func:`~gas_lab.rules.refusals.enforce`, which the engine calls. What a rule
  is: :mod:`~gas_lab.rules.rule`; the rules, by topic: :mod:`~gas_lab.rules.config_refusals`,
  :mod:`~gas_lab.rules.call_refusals`, :mod:`~gas_lab.rules.idle_rank_refusals`,
  :mod:`~gas_lab.rules.out_of_scope`.
* :mod:`~gas_lab.rules.traps`: combinations DeepSpeed accepts that still train wrong.

What runs configs to measure them (the matrix, predictions, the unsafe teaching mode) lives
with the other measurements, in :mod:`gas_lab.measure`.
"""

# Every rule registered by name before any is looked up: a rule pickled on a rank is rebuilt
# by gas_lab.rules.rule.rule_named, and importing that module runs this one first.
from gas_lab.rules import refusals as refusals
