"""DeepSpeed's own optimizer construction, run in this process without a process group or a JIT
build (tests/test_config.py and tests/test_config_fuzz.py compare gas_lab with it)."""

import os
import types

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


class _NoBuild:
    """Stands in for FusedAdamBuilder: FusedAdam's own __init__ runs (its defaults, its
    AMSGrad refusal); only the C++ kernel is not built (the optimizer is never stepped)."""

    def load(self):
        return types.SimpleNamespace(multi_tensor_adam=None)


def deepspeed_builds(optimizer: dict, monkeypatch) -> tuple[str, dict]:
    """(class name, hyper-parameters) of what ``deepspeed.initialize`` builds for this
    ``"optimizer"`` block, from DeepSpeed 0.19.8's own engine methods; raises what they raise.

    For FusedAdam the class name says the math: ``FusedAdam/AdamW`` or ``FusedAdam/Adam``."""
    import deepspeed.ops.adam.fused_adam as fused_adam
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    monkeypatch.setattr(fused_adam, "FusedAdamBuilder", _NoBuild)
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)  # only the optimizer methods are used
    torch.nn.Module.__init__(engine)
    engine.client_optimizer, engine.zenflow = None, False
    engine._config = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "optimizer": optimizer})
    name = engine.optimizer_name()
    assert engine._is_supported_optimizer(name), f"{name} is not a supported DeepSpeed Optimizer"
    built = engine._configure_basic_optimizer([torch.nn.Parameter(torch.zeros(2))])
    cls = type(built).__name__
    if cls == "FusedAdam":
        cls += "/AdamW" if built.adam_w_mode else "/Adam"
    return cls, {k: v for k, v in built.param_groups[0].items() if k != "params"}


def gas_lab_builds(optimizer: dict) -> tuple[str, dict]:
    """The same for gas_lab (FusedAdam's path named as DeepSpeed names it)."""
    from gas_lab.deepspeed_compat.config import load_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": optimizer})
    plan = cfg.optimizer.plan()
    built = plan.build([torch.nn.Parameter(torch.zeros(2))])
    cls = type(built).__name__
    if plan.path == "fused":
        cls = f"FusedAdam/{cls}"
    return cls, {k: v for k, v in built.param_groups[0].items() if k != "params"}
