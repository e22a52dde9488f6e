"""The config's optimizer block, built the way DeepSpeed 0.19.8 builds it, path by path.

``"optimizer": {"type": ..., "params": {...}}`` takes one of three paths in DeepSpeed, and the
defaults of what you leave out depend on the path (``table()`` prints this):

===========================  =================================  ======================================
type and ``torch_adam``      DeepSpeed builds                   defaults for what params leave out
===========================  =================================  ======================================
Adam/AdamW, no torch_adam    ``FusedAdam`` (its C++ op,         lr 1e-3, betas (0.9, 0.999), eps 1e-8,
                             JIT-built once per machine)        **weight_decay 0.0**
Adam/AdamW, torch_adam true  ``torch.optim.AdamW`` or ``Adam``  torch's: AdamW **weight_decay 0.01**
SGD                          ``torch.optim.SGD``                torch's (lr 1e-3, momentum 0)
===========================  =================================  ======================================

The math is AdamW (decoupled weight decay) when the type is AdamW or ``adam_w_mode`` is true
(its default); type Adam with ``adam_w_mode`` false, ``0`` or ``null`` is Adam with an L2
term. DeepSpeed reads ``torch_adam`` and ``adam_w_mode`` by truthiness (``null`` is false);
gas_lab accepts true, false, 0, 1 and null for them and refuses strings (``"no"`` is true).
Type names: DeepSpeed lower-cases its own ("ADAM" is adam) and looks any other name up in
``torch.optim`` as written, so "SGD" works and "sgd" is refused (AssertionError).

The keys of ``params`` are checked by one pydantic model per path (:data:`PARAMS`), the same
mechanism as the rest of the config (:mod:`.config`). Read by :mod:`.config` (lesson 03);
``tests/test_config.py`` holds every row against DeepSpeed's own construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from gas_lab.errors import ConfigError, NotImplementedInGasLab

# DeepSpeed's own optimizer names (lower-cased there); the rest are torch.optim names.
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion",
                        "muon")  # fmt: skip
# FusedAdam's defaults for what the params leave out: torch's, except weight_decay (AdamW's
# default is 0.01 in torch, 0.0 here).
FUSED_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


# -- the keys of "params", one pydantic model per path ------------------------------------------
# A refusal is a PydanticCustomError whose type names what DeepSpeed raises for the value
# ("TypeError", "AssertionError", ... or "not_supported" for what gas_lab leaves out); check()
# turns the first one into a ConfigError of that type, naming the key.
def _refuse(raises: str, reason: str):
    return PydanticCustomError(raises, reason)


class Passed:
    """Marks a key passed on to the torch optimizer (the others choose the path or do nothing)."""


PASSED = Passed()


def _not_null(value) -> None:
    if value is None:
        raise _refuse(
            "TypeError",
            "null; DeepSpeed passes it to the optimizer, which raises "
            "TypeError (leave the key out for the default)",
        )


def _number(value, signed=False):
    _not_null(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse("TypeError", f"must be a number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise _refuse("ValueError", f"must be finite, got {value!r}")
    if value < 0 and not signed:
        raise _refuse(
            "ValueError",
            f"must be >= 0, got {value!r} (torch raises ValueError; "
            "DeepSpeed's FusedAdam takes a negative lr as ascent and ignores a negative "
            "weight_decay)",
        )
    return value


def _betas(value):
    _not_null(value)
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if ok and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value):
        if all(0.0 <= b < 1.0 for b in value):  # NaN fails this too
            return tuple(value)
        raise _refuse("ValueError", f"each beta must be in [0, 1), got {value!r}")
    raise _refuse("TypeError", f"must be two numbers, got {value!r}")


def _flag(value):
    if value is not None and not isinstance(value, bool):
        raise _refuse("ValueError", f"must be true, false or null, got {value!r}")
    return value


def _switch(value):
    if value not in (None, True, False, 0, 1) or isinstance(value, float):
        raise _refuse(
            "ValueError",
            f"must be true, false, 0, 1 or null, got {value!r} "
            "(DeepSpeed reads it by truthiness: the string 'no' means true)",
        )
    return value


def _max_grad_norm(value):
    if value is None:  # any other value: refused by gas_lab.rules.refusals, as DeepSpeed
        raise _refuse(
            "TypeError",
            "null; DeepSpeed raises TypeError on it at initialize (use "
            "the top-level gradient_clipping)",
        )
    return value


def _amsgrad_fused(value):
    if _flag(value):
        raise _refuse(
            "RuntimeError",
            "FusedAdam (DeepSpeed's Adam without torch_adam) has no "
            "AMSGrad variant: DeepSpeed raises RuntimeError at initialize; add "
            '"torch_adam": true for torch\'s AMSGrad',
        )
    return value


def _bias_correction(value):
    if not _flag(value):  # FusedAdam then skips the bias correction; torch's Adam always applies it
        raise _refuse(
            "not_supported",
            f"{value!r} (no bias correction) is not supported by gas_lab; use deepspeed.initialize",
        )
    return value


def _not_modelled(value):
    raise _refuse(
        "not_supported",
        "not supported by gas_lab (DeepSpeed passes it to the "
        "optimizer); remove it or use deepspeed.initialize",
    )


Number = Annotated[Any, BeforeValidator(_number), PASSED]
SignedNumber = Annotated[Any, BeforeValidator(lambda v: _number(v, signed=True)), PASSED]
Betas = Annotated[Any, BeforeValidator(_betas), PASSED]
Flag = Annotated[Any, BeforeValidator(_flag), PASSED]
Ignored = Annotated[Any, BeforeValidator(_flag)]  # DeepSpeed takes it; it changes nothing here
Switch = Annotated[Any, BeforeValidator(_switch)]  # chooses the path (torch_adam, adam_w_mode)
NotModelled = Annotated[Any, BeforeValidator(_not_modelled)]
MaxGradNorm = Annotated[Any, BeforeValidator(_max_grad_norm)]


class _Params(BaseModel):
    # forbid: a key the optimizer does not take is DeepSpeed's TypeError, not a default.
    model_config = ConfigDict(extra="forbid")
    lr: Number = None
    weight_decay: Number = None
    max_grad_norm: MaxGradNorm = None  # (refused as a rule, gas_lab.rules.refusals)


class _AdamParams(_Params):
    betas: Betas = None
    eps: Number = None
    amsgrad: Flag = None
    fp32_optimizer_states: Ignored = None  # CPU offload only
    torch_adam: Switch = None
    adam_w_mode: Switch = None


class FusedAdamParams(_AdamParams):
    """Adam/AdamW without ``torch_adam``: DeepSpeed's ``FusedAdam``."""

    amsgrad: Annotated[Any, BeforeValidator(_amsgrad_fused), PASSED] = None
    bias_correction: Annotated[Any, BeforeValidator(_bias_correction), PASSED] = None
    set_grad_none: Ignored = None  # zero_grad's behaviour


class _TorchKeys(_Params):
    """What torch's own optimizers take besides their hyper-parameters."""

    foreach: Flag = None
    maximize: Flag = None
    differentiable: NotModelled = None
    fused: NotModelled = None


class TorchAdamParams(_AdamParams, _TorchKeys):
    """Adam/AdamW with ``torch_adam``: ``torch.optim.Adam`` or ``AdamW``."""

    capturable: NotModelled = None
    decoupled_weight_decay: NotModelled = None


class SgdParams(_TorchKeys):
    """``torch.optim.SGD``."""

    momentum: Number = None
    dampening: SignedNumber = None
    nesterov: Flag = None


PARAMS = {"fused": FusedAdamParams, "torch": TorchAdamParams, "sgd": SgdParams}
BUILDERS = {"fused": "FusedAdam", "torch": "torch.optim.Adam/AdamW", "sgd": "torch.optim.SGD"}
_RAISES = {"TypeError": TypeError, "AssertionError": AssertionError, "RuntimeError": RuntimeError}


def passed_keys(path: str) -> tuple[str, ...]:
    """The keys of ``path``'s params that go to the torch optimizer."""
    return tuple(k for k, f in PARAMS[path].model_fields.items() if PASSED in f.metadata)


@dataclass(frozen=True)
class Plan:
    """What to build for one optimizer block: ``cls(parameters, **kwargs)``."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    deepspeed_builds: str  # what DeepSpeed 0.19.8 builds for the same block
    path: str  # "fused", "torch" or "sgd"

    def build(self, parameters) -> torch.optim.Optimizer:
        return self.cls(parameters, **self.kwargs)


def normalize_type(name: Any) -> str:
    """The type as DeepSpeed resolves it: "Adam", "AdamW" or "SGD"; refuses the others."""
    if not isinstance(name, str):
        raise ConfigError("optimizer.type", f"must be a string, got {name!r}")
    if name.lower() in ("adam", "adamw"):
        return {"adam": "Adam", "adamw": "AdamW"}[name.lower()]
    if name == "SGD":
        return name
    if name.lower() in DEEPSPEED_OPTIMIZERS or getattr(torch.optim, name, None) is not None:
        raise NotImplementedInGasLab(
            f"optimizer.type {name!r}: gas_lab teaches with SGD, Adam and AdamW; "
            "use deepspeed.initialize for other optimizers."
        )
    raise ConfigError(
        "optimizer.type",
        f"{name!r} is neither a DeepSpeed nor a torch optimizer (DeepSpeed: AssertionError "
        "'not a supported DeepSpeed Optimizer'; torch names are case-sensitive: 'SGD')",
        deepspeed_raises=AssertionError,
    )


def _path(kind: str, params: dict) -> str:
    if kind == "SGD":
        return "sgd"
    return "torch" if params.get("torch_adam") else "fused"


def check(kind: str, params: Any) -> dict:
    """Check ``params`` for optimizer ``kind`` (normalized) with its path's model; return them
    unchanged.

    Every refusal names the key (``optimizer.params.lr``) and says why, and is an instance of
    what DeepSpeed raises for it where that is a TypeError, AssertionError or RuntimeError.
    """
    if not isinstance(params, dict):
        raise ConfigError("optimizer.params", f"must be a dict, got {params!r}")
    path = _path(kind, params)
    try:
        PARAMS[path].model_validate(params)
    except ValidationError as err:
        # The first problem in the order the keys were written, as DeepSpeed meets them.
        order = {str(k): i for i, k in enumerate(params)}
        first = min(err.errors(), key=lambda e: order.get(str(e["loc"][0]), len(order)))
        raise _refusal(path, str(first["loc"][0]), first) from None
    if path == "sgd" and params.get("nesterov"):
        if not params.get("momentum", 0) > 0 or params.get("dampening", 0) != 0:
            raise ConfigError(
                "optimizer.params.nesterov",
                "Nesterov momentum needs momentum > 0 and dampening 0 (torch raises ValueError)",
            )
    return params


def _refusal(path: str, key: str, error: dict) -> Exception:
    where, builder = f"optimizer.params.{key}", BUILDERS[path]
    if error["type"] == "extra_forbidden":
        other = [BUILDERS[p] for p, model in PARAMS.items() if key in model.model_fields]
        hint = f"a parameter of {other[0]} only" if other else "unknown; check the spelling"
        return ConfigError(
            where,
            f"{hint}: DeepSpeed passes it on to {builder}, which raises "
            "TypeError (unexpected keyword argument)",
            deepspeed_raises=TypeError,
        )
    if error["type"] == "not_supported":
        return NotImplementedInGasLab(f"config key '{where}': {error['msg']} ({builder})")
    return ConfigError(where, error["msg"], deepspeed_raises=_RAISES.get(error["type"]))


def plan(kind: str, params: dict) -> Plan:
    """What DeepSpeed builds for ``{"type": kind, "params": params}`` (checked), as torch.

    gas_lab always steps a torch optimizer: on the fused path it is torch's Adam/AdamW with
    FusedAdam's hyper-parameters (defaults included), which DeepSpeed's CPU kernel matches to
    one or two float32 ulps (the kernel rounds differently; 1.2e-7 after 3 steps measured).
    """
    path = _path(kind, params)
    passed = passed_keys(path)
    kwargs = {k: v for k, v in params.items() if k in passed and v is not None}
    kwargs.pop("bias_correction", None)  # true (checked): torch's Adam always corrects
    if path == "sgd":
        return Plan(torch.optim.SGD, kwargs, "torch.optim.SGD", path)
    adam_w = kind == "AdamW" or bool(params.get("adam_w_mode", True))
    cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    if path == "torch":
        built = f"torch.optim.{cls.__name__}"
    else:
        kwargs = {**FUSED_DEFAULTS, **kwargs}
        built = f"FusedAdam(adam_w_mode={int(adam_w)})"
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return Plan(cls, kwargs, built, path)


def table() -> list[dict[str, str]]:
    """The paths of the module docstring, computed: one row per (type, torch_adam, adam_w_mode)."""
    rows = []
    for kind in ("Adam", "AdamW"):
        for torch_adam in (None, True):
            for adam_w_mode in (None, False):
                params = {
                    k: v
                    for k, v in (("torch_adam", torch_adam), ("adam_w_mode", adam_w_mode))
                    if v is not None
                }
                p = plan(kind, params)
                rows.append(
                    {
                        "type": kind,
                        "params": str(params),
                        "DeepSpeed builds": p.deepspeed_builds,
                        "gas_lab builds": p.cls.__name__,
                        "weight_decay": str(p.build([torch.zeros(1)]).defaults["weight_decay"]),
                    }
                )
    p = plan("SGD", {})
    rows.append(
        {
            "type": "SGD",
            "params": "{}",
            "DeepSpeed builds": p.deepspeed_builds,
            "gas_lab builds": "SGD",
            "weight_decay": "0",
        }
    )
    return rows
