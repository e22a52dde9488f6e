"""What gas_lab raises on purpose, in one place.

* :class:`ConfigError`: a bad key or value in the config; names the key and the reason.
* :class:`RejectedCombination`: a combination DeepSpeed 0.19.8 refuses too (the rules in
  :mod:`gas_lab.rules.refusals`); the message names the keys and says why, and the exception is
  also an instance of the type DeepSpeed raises there (``AssertionError``, ``ValueError``...).
* :class:`NotImplementedInGasLab`: fine in DeepSpeed, deliberately left out of the course.

All three are :class:`GasLabError`, so ``except GasLabError`` catches what gas_lab means to
raise and nothing else.
"""

from __future__ import annotations

import builtins


class GasLabError(Exception):
    """Base class of every error gas_lab raises on purpose."""


class ConfigError(GasLabError, ValueError):
    """A bad config: ``path`` is the key (``zero_optimization.stage``), ``reason`` the problem.

    A ValueError, like the pydantic error DeepSpeed raises for most bad keys. Where DeepSpeed
    raises something else for the same value (``"type": "sgd"``: AssertionError, a null
    ``lr``: TypeError, ``amsgrad`` on FusedAdam: RuntimeError), ``deepspeed_raises=`` makes
    the error an instance of that type too, so code written for DeepSpeed catches it.
    """

    def __new__(cls, path: str, reason: str, deepspeed_raises: type | None = None):
        if deepspeed_raises is not None and not issubclass(cls, deepspeed_raises):
            cls = _CONFIG_ERRORS[deepspeed_raises]
        return super().__new__(cls, path, reason)

    def __init__(self, path: str, reason: str, deepspeed_raises: type | None = None):
        self.path, self.reason = path, reason
        super().__init__(f"config key '{path}': {reason}")

    def __reduce__(self):  # rebuilt from (path, reason) when sent back from a rank
        return (type(self), (self.path, self.reason))


class ConfigTypeError(ConfigError, TypeError):
    """A ConfigError where DeepSpeed raises TypeError (a null or non-numeric value)."""


class ConfigAssertionError(ConfigError, AssertionError):
    """A ConfigError where DeepSpeed raises AssertionError."""


class ConfigRuntimeError(ConfigError, RuntimeError):
    """A ConfigError where DeepSpeed raises RuntimeError."""


class ConfigZeroDivisionError(ConfigError, ZeroDivisionError):
    """A ConfigError where DeepSpeed divides by the value (``steps_per_print: 0``)."""


_CONFIG_ERRORS = {
    TypeError: ConfigTypeError,
    AssertionError: ConfigAssertionError,
    RuntimeError: ConfigRuntimeError,
    ZeroDivisionError: ConfigZeroDivisionError,
}


class RejectedCombination(GasLabError):
    """A combination DeepSpeed rejects too; the message names the keys and says why.

    ``rule`` is the :class:`gas_lab.rules.refusals.Rule` that fired. gas_lab raises
    ``RejectedCombination.of(rule)``: an instance of a subclass (named ``RejectedCombination``
    too) that also derives from the type DeepSpeed raises for that rule
    (``rule.deepspeed_raises``), so a loop written for DeepSpeed, with ``except AssertionError``
    or ``pytest.raises(ValueError)``, catches gas_lab's refusal as it would DeepSpeed's.
    """

    def __init__(self, rule):
        self.rule = rule
        super().__init__(
            f"{' + '.join(rule.keys)}: {rule.reason}\n  Prevents: {rule.prevents}"
            f"\n  Refused as by DeepSpeed 0.19.8, which raises {rule.deepspeed_raises} at "
            f"{rule.moment}: {rule.deepspeed_message!r}"
        )

    @classmethod
    def of(cls, rule) -> RejectedCombination:
        """The refusal for ``rule``, an instance of DeepSpeed's exception type for it too."""
        return _refusal_class(rule.deepspeed_raises)(rule)

    def __reduce__(self):  # ranks send exceptions back pickled (a Rule pickles itself)
        return RejectedCombination.of, (self.rule,)


_REFUSAL_CLASSES: dict[str, type] = {}


def deepspeed_exception_type(name: str) -> type | None:
    """The exception class DeepSpeed raises, from its name in a rule: a builtin
    (``"AssertionError"``) or ``"DeepSpeedConfigError"`` (imported from DeepSpeed, only then)."""
    if name == "DeepSpeedConfigError":
        try:
            from deepspeed.runtime.config import DeepSpeedConfigError
        except ImportError:  # no DeepSpeed here: nothing written for it to catch
            return None
        return DeepSpeedConfigError
    found = getattr(builtins, name, None)
    return found if isinstance(found, type) and issubclass(found, Exception) else None


def _refusal_class(name: str) -> type:
    if name not in _REFUSAL_CLASSES:
        base = deepspeed_exception_type(name)
        bases = (RejectedCombination,) if base is None else (RejectedCombination, base)
        attrs = {"__module__": __name__, "__qualname__": "RejectedCombination"}
        _REFUSAL_CLASSES[name] = type("RejectedCombination", bases, attrs)
    return _REFUSAL_CLASSES[name]


class NotImplementedInGasLab(GasLabError, NotImplementedError):
    """Something DeepSpeed supports that this course deliberately leaves out."""
