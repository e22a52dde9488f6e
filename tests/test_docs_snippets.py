"""The code the docs pages teach runs, and trains to the right weights.

docs/concepts/boundary.md shows the unmanaged loop with its divisor (the global count / W). A
divisor that is W times off, or a per-rank count, trains silently wrong, so the snippet is run
here as written, on 2 ranks with a different number of micro-batches on each, on gas_lab and on
DeepSpeed, and compared with one process that takes every micro-batch of a step in one mean.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,  # never the number of micro-batches a step runs here
    "managed_gradient_accumulation": False,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
}
PER_RANK = [[3, 1], [1, 4]]  # micro-batches of (rank 0, rank 1) in each step


def _unmanaged_snippet() -> str:
    text = (ROOT / "docs" / "concepts" / "boundary.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    (snippet,) = [b for b in blocks if "scale_wrt_gas=False" in b]
    return snippet


def _run_snippet(snippet, lib, config, per_rank):
    """On a rank: each step, build this rank's micro-batches and run the docs' code as written."""
    import torch
    import torch.distributed as dist

    from gas_lab.dp import global_count
    from gas_lab.measure.parity import initializer
    from gas_lab.toys import flat_params, micro_batch, tiny_model

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = tiny_model(0)
    engine = initializer(lib)(model=model, model_parameters=model.parameters(), config=config)[0]
    for step, counts in enumerate(per_rank):
        micro_batches = [micro_batch(0, step, m, rank, 2) for m in range(counts[rank])]
        names = {
            "engine": engine,
            "micro_batches": micro_batches,
            "loss_fn": torch.nn.functional.mse_loss,
            "global_count": global_count,
            "world_size": world_size,
        }
        exec(snippet, names)  # the page's code, unchanged
    return flat_params(engine.module)


@pytest.mark.ranks
def test_the_unmanaged_loop_of_the_boundary_page_trains_to_the_reference(cluster):
    from gas_lab.measure.parity import reference_params

    reference = reference_params(CONFIG, len(PER_RANK), lambda step, rank: PER_RANK[step][rank])
    snippet = _unmanaged_snippet()
    for lib in ("gas_lab", "deepspeed"):
        for params in cluster.run(_run_snippet, snippet, lib, CONFIG, PER_RANK, timeout=120):
            assert (params - reference).abs().max().item() < 1e-6, lib
    # and the test can fail: the old divisor (this rank's own count) is measurably wrong
    own = snippet.replace("global_count(len(micro_batches))", "len(micro_batches)")
    own = own.replace("(n / world_size)", "n")
    assert own != snippet
    wrong = cluster.run(_run_snippet, own, "gas_lab", CONFIG, PER_RANK, timeout=120)[0]
    assert (wrong - reference).abs().max().item() > 1e-2
