"""What the 2-rank parity tests share: the optimizers, the config, one case run on a rank, and
the check that gas_lab and DeepSpeed ended the same (tests/test_parity.py: stage 0,
tests/test_zero1.py: stage 1)."""

TOL = 1e-6
SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
ADAM = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}}
ADAM_L2 = {  # adam_w_mode false: torch.optim.Adam, weight decay as an L2 term in the gradient
    "type": "Adam",
    "params": {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False, "torch_adam": True},
}


def config(optimizer, gas, managed=True, stage=None, **extra):
    """A DeepSpeed config; ``stage=None`` leaves ZeRO out (DeepSpeed's default, stage 0)."""
    zero = {}
    if stage is not None:  # SGD under ZeRO needs DeepSpeed's opt-in
        zero = {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "managed_gradient_accumulation": managed,
        "optimizer": optimizer,
        **zero,
        **extra,
    }


def run_case(cfg, kw):
    """On a rank: one parity run -> (max diff, counters, collectives, first gas_lab loss)."""
    from gas_lab.measure.parity import run_parity

    kw = dict(kw)
    if kw.pop("per_rank_n", False):  # ranks run different numbers of micro-batches
        kw["micro_batches"] = lambda step, rank: 1 + (step + 2 * rank) % 4
    r = run_parity(cfg, **kw)
    return r.max_abs_diff, r.counters, r.collectives, r.losses["gas_lab"][0]


def assert_same(results, name):
    """Both ranks: parameters within TOL, counters and collectives equal, and the ranks really
    saw different data (the comparison would be vacuous otherwise)."""
    for diff, counters, collectives, _ in results:
        assert diff <= TOL, f"{name}: max |gas_lab - DeepSpeed| = {diff:.3g}"
        assert counters["gas_lab"] == counters["deepspeed"]
        assert collectives["gas_lab"] == collectives["deepspeed"]
    assert results[0][3] != results[1][3]
