"""What gas_lab raises on purpose, in one place.

* :class:`ConfigError`: a bad key or value in the config; names the key and the reason.
* :class:`RejectedCombination`: a combination DeepSpeed 0.19.8 refuses too (the rules in
  :mod:`gas_lab.rules.refusals`); the message names the keys and says why.
* :class:`NotImplementedInGasLab`: fine in DeepSpeed, deliberately left out of the course.

All three are :class:`GasLabError`, so ``except GasLabError`` catches what gas_lab means to
raise and nothing else.
"""

from __future__ import annotations


class GasLabError(Exception):
    """Base class of every error gas_lab raises on purpose."""


class ConfigError(GasLabError, ValueError):
    """A bad config: ``path`` is the key (``zero_optimization.stage``), ``reason`` the problem."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"config key '{path}': {reason}")


class RejectedCombination(GasLabError):
    """A combination DeepSpeed rejects too; the message names the keys and says why.

    ``rule`` is the :class:`gas_lab.rules.refusals.Rule` that fired.
    """

    def __init__(self, rule):
        self.rule = rule
        super().__init__(
            f"{' + '.join(rule.keys)}: {rule.reason}\n  Silent failure prevented: {rule.prevents}"
            f"\n  Refused as by DeepSpeed 0.19.8, which raises {rule.deepspeed_raises} at "
            f"{rule.moment}: {rule.deepspeed_message!r}"
        )


class NotImplementedInGasLab(GasLabError, NotImplementedError):
    """Something DeepSpeed supports that this course deliberately leaves out."""
