"""gas_lab.dp on 2 ranks: naive and no_sync data parallelism give the full-batch gradient step;
naive pays one all-reduce per micro-batch, no_sync one per optimizer step."""

import pytest

pytestmark = pytest.mark.ranks


def _run(kind, n, steps, lr=0.1):
    import torch
    import torch.distributed as dist

    from gas_lab import dp, initialize
    from gas_lab.measure.comm import count_collectives
    from gas_lab.toys import micro_batch, tiny_model

    rank, world = dist.get_rank(), dist.get_world_size()
    mse = torch.nn.functional.mse_loss
    model = tiny_model(rank)  # different init per rank: the wrapper's broadcast must fix it
    if kind == "engine":
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": n,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": lr}},
        }
        wrapped, opt, _, _ = initialize(model=model, config=config)
    else:
        cls = dp.NaiveDataParallel if kind == "naive" else dp.NoSyncDataParallel
        wrapped = cls(model)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    with count_collectives() as log:
        for step in range(steps):
            batches = [micro_batch(0, step, m, rank, 2) for m in range(n)]
            if kind == "engine":
                for x, y in batches:
                    wrapped.backward(mse(wrapped(x), y))
                    wrapped.step()
            else:
                dp.train_step(wrapped, opt, batches, mse)

    # Reference, computed alone on each rank: one model, every rank's data, one step per step.
    ref = tiny_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        for r in range(world):
            for m in range(n):
                x, y = micro_batch(0, step, m, r, 2)
                (mse(ref(x), y) / (n * world)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = max(
        (p - q).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    return diff, log.count("all_reduce"), log.total_bytes("all_reduce"), param_bytes


@pytest.mark.parametrize("kind", ["naive", "no_sync", "engine"])
@pytest.mark.parametrize("n", [1, 3])
def test_data_parallel_equals_full_batch_step(cluster, kind, n):
    steps = 2
    results = cluster.run(_run, kind, n, steps)
    for diff, calls, nbytes, param_bytes in results:
        assert diff <= 1e-6
        # naive: every micro-batch's backward all-reduces; no_sync and the engine: once a step
        expected = steps * n if kind == "naive" else steps
        assert calls == expected
        assert nbytes == expected * param_bytes


def test_no_sync_restores_the_flag():
    import torch

    from gas_lab.dp import NoSyncDataParallel

    model = NoSyncDataParallel(torch.nn.Linear(2, 2), group=None)
    with model.no_sync():
        assert not model.require_backward_grad_sync
        with model.no_sync():
            pass
        assert not model.require_backward_grad_sync
    assert model.require_backward_grad_sync
