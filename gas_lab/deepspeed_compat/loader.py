"""The data loader ``initialize(training_data=...)`` returns, as DeepSpeed 0.19.8 builds it.

DeepSpeed's ``deepspeed_io`` wraps the dataset in a loader whose sampler is
``DistributedSampler(dataset, num_replicas=world_size, rank=rank)`` with torch's defaults
(``shuffle=True, seed=0, drop_last=False``), and whose batch is ``train_micro_batch_size_per_gpu``:
it yields **micro-batches**, one rank's share, and knows nothing about accumulation (the loop
calls ``backward()`` on GAS of them per step). It has no ``set_epoch``: every epoch repeats the
same order unless you call ``loader.data_sampler.set_epoch(epoch)`` yourself.

gas_lab returns a plain ``torch.utils.data.DataLoader`` with the same sampler and batch size
(so each rank gets the same micro-batches as under DeepSpeed), ``data_sampler`` naming the
sampler as DeepSpeed does, and ``num_workers=0``: DeepSpeed starts 2 worker processes per rank
and pins memory, which changes neither the order nor the values, only costs processes inside
the notebook's ranks. Taught in lesson 08 (``tutorials/08_edges.ipynb``).
"""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


def training_loader(
    dataset,
    micro_batch_size: int,
    world_size: int,
    rank: int,
    collate_fn=None,
    drop_last: bool = False,
) -> DataLoader:
    """Rank ``rank``'s loader of micro-batches over its shard of ``dataset``."""
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Dataset):
        # DeepSpeed accepts iterable datasets too, but a DistributedSampler cannot shard them.
        raise ValueError(
            "training_data must be a map-style torch Dataset (gas_lab shards it with a "
            f"DistributedSampler); got {type(dataset).__name__}"
        )
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        num_workers=0,
    )
    loader.data_sampler = sampler  # DeepSpeed's name for it
    return loader


__all__ = ["training_loader"]
