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

Read by :mod:`gas_lab.deepspeed_compat.config` (lesson 03); ``tests/test_config.py`` holds every row against
DeepSpeed's own construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gas_lab.errors import ConfigError, NotImplementedInGasLab

# DeepSpeed's own optimizer names (lower-cased there); the rest are torch.optim names.
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion",
                        "muon")  # fmt: skip
# FusedAdam's defaults for what the params leave out: torch's, except weight_decay (AdamW's
# default is 0.01 in torch, 0.0 here).
FUSED_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}

# What each key of "params" is, per path. number/betas/flag: checked and passed on to the torch
# optimizer (a null flag counts as false, as DeepSpeed's truthiness has it); switch: read by
# gas_lab to choose the path; ignored: DeepSpeed takes it and it changes nothing gas_lab runs
# (set_grad_none: zero_grad's behaviour; fp32_optimizer_states: CPU offload only); other: a
# keyword DeepSpeed's optimizer takes that gas_lab does not model, refused as not supported.
_ADAM = {"lr": "number", "betas": "betas", "eps": "number", "weight_decay": "number",
         "amsgrad": "flag", "fp32_optimizer_states": "ignored", "torch_adam": "switch",
         "adam_w_mode": "switch"}  # fmt: skip
SPEC = {
    "fused": {**_ADAM, "bias_correction": "flag", "set_grad_none": "ignored"},
    "torch": {**_ADAM, "foreach": "flag", "maximize": "flag", "capturable": "other",
              "differentiable": "other", "fused": "other", "decoupled_weight_decay": "other"},
    "sgd": {"lr": "number", "momentum": "number", "dampening": "number", "weight_decay": "number",
            "nesterov": "flag", "foreach": "flag", "maximize": "flag", "differentiable": "other",
            "fused": "other"},
}  # fmt: skip
BUILDERS = {"fused": "FusedAdam", "torch": "torch.optim.Adam/AdamW", "sgd": "torch.optim.SGD"}


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
    """Check ``params`` for optimizer ``kind`` (normalized); return them unchanged.

    Every refusal names the key (``optimizer.params.lr``) and says why, and is an instance of
    what DeepSpeed raises for it where that is a TypeError, AssertionError or RuntimeError.
    """
    if not isinstance(params, dict):
        raise ConfigError("optimizer.params", f"must be a dict, got {params!r}")
    path = _path(kind, params)
    for key, value in params.items():
        _check_one(path, str(key), value)
    if path == "sgd" and params.get("nesterov"):
        if not params.get("momentum", 0) > 0 or params.get("dampening", 0) != 0:
            raise ConfigError(
                "optimizer.params.nesterov",
                "Nesterov momentum needs momentum > 0 and dampening 0 (torch raises ValueError)",
            )
    return params


def _check_one(path: str, key: str, value: Any) -> None:
    where, builder, kind = f"optimizer.params.{key}", BUILDERS[path], SPEC[path].get(key)
    if key == "max_grad_norm":
        if value is None:  # any other value: refused by gas_lab.rules.refusals, as DeepSpeed
            raise ConfigError(where, "null; DeepSpeed raises TypeError on it at initialize "
                              "(use the top-level gradient_clipping)", deepspeed_raises=TypeError)  # fmt: skip
        return
    if kind is None:
        other = [BUILDERS[p] for p in SPEC if key in SPEC[p]]
        hint = f"a parameter of {other[0]} only" if other else "unknown; check the spelling"
        raise ConfigError(where, f"{hint}: DeepSpeed passes it on to {builder}, which raises "
                          "TypeError (unexpected keyword argument)", deepspeed_raises=TypeError)  # fmt: skip
    if kind == "other":
        raise NotImplementedInGasLab(f"config key '{where}': not supported by gas_lab ({builder} "
                                     "takes it); remove it or use deepspeed.initialize")  # fmt: skip
    if kind == "switch":
        if value not in (None, True, False, 0, 1) or isinstance(value, float):
            raise ConfigError(where, f"must be true, false, 0, 1 or null, got {value!r} "
                              "(DeepSpeed reads it by truthiness: the string 'no' means true)")  # fmt: skip
    elif kind in ("flag", "ignored"):
        if value is not None and not isinstance(value, bool):
            raise ConfigError(where, f"must be true, false or null, got {value!r}")
        if path == "fused":
            _check_fused_flag(key, value, where)
    elif value is None:
        raise ConfigError(where, f"null; DeepSpeed passes it to {builder}, which raises "
                          "TypeError (leave the key out for the default)", deepspeed_raises=TypeError)  # fmt: skip
    elif kind == "number":
        _check_number(where, key, value)
    else:
        _check_betas(where, value)


def _check_fused_flag(key: str, value: Any, where: str) -> None:
    if key == "amsgrad" and value:
        raise ConfigError(
            where,
            "FusedAdam (DeepSpeed's Adam without torch_adam) has no AMSGrad variant: DeepSpeed "
            'raises RuntimeError at initialize; add "torch_adam": true for torch\'s AMSGrad',
            deepspeed_raises=RuntimeError,
        )
    if key == "bias_correction" and not value:
        # FusedAdam then skips the bias correction; torch's Adam always applies it.
        raise NotImplementedInGasLab(
            f"config key '{where}': {value!r} (no bias correction) is not supported by gas_lab; "
            "use deepspeed.initialize"
        )


def _check_number(where: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(where, f"must be a number, got {value!r}", deepspeed_raises=TypeError)
    if math.isnan(value) or math.isinf(value):
        raise ConfigError(where, f"must be finite, got {value!r}")
    if value < 0 and key != "dampening":
        raise ConfigError(
            where,
            f"must be >= 0, got {value!r} (torch raises ValueError; DeepSpeed's FusedAdam "
            "takes a negative lr as ascent and ignores a negative weight_decay)",
        )


def _check_betas(where: str, value: Any) -> None:
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if ok and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value):
        if all(0.0 <= b < 1.0 for b in value):  # NaN fails this too
            return
        raise ConfigError(where, f"each beta must be in [0, 1), got {value!r}")
    raise ConfigError(where, f"must be two numbers, got {value!r}", deepspeed_raises=TypeError)


def plan(kind: str, params: dict) -> Plan:
    """What DeepSpeed builds for ``{"type": kind, "params": params}`` (checked), as torch.

    gas_lab always steps a torch optimizer: on the fused path it is torch's Adam/AdamW with
    FusedAdam's hyper-parameters (defaults included), which DeepSpeed's CPU kernel matches to
    one or two float32 ulps (the kernel rounds differently; 1.2e-7 after 3 steps measured).
    """
    path = _path(kind, params)
    passed = ("number", "betas", "flag")
    kwargs = {k: v for k, v in params.items() if SPEC[path].get(k) in passed and v is not None}
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
                params = {k: v for k, v in (("torch_adam", torch_adam), ("adam_w_mode", adam_w_mode))
                          if v is not None}  # fmt: skip
                p = plan(kind, params)
                rows.append({"type": kind, "params": str(params), "DeepSpeed builds": p.deepspeed_builds,
                             "gas_lab builds": p.cls.__name__,
                             "weight_decay": str(p.build([torch.zeros(1)]).defaults["weight_decay"])})  # fmt: skip
    p = plan("SGD", {})
    rows.append({"type": "SGD", "params": "{}", "DeepSpeed builds": p.deepspeed_builds,
                 "gas_lab builds": "SGD", "weight_decay": "0"})  # fmt: skip
    return rows
