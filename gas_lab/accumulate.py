"""Gradient accumulation on one device, and the loss normalizations that make it right.

The invariant: summing the gradients of N micro-batch losses gives the gradient of the loss you
*meant* on the whole batch, but only if each micro-batch loss is scaled with counts of the
*whole accumulation window* (N, its samples, its real tokens), never of one micro-batch alone.

Taught in lesson 01 (``tutorials/01_single_device.ipynb``); lesson 07 reuses :class:`Window`
and :func:`normalized_loss` across ranks. The toy models and data are in
:mod:`gas_lab.toys`.

Conventions: a loss function ``loss_fn(model, batch)`` returns per-token losses of shape
``(batch, tokens)``. A batch without a mask has one loss term per sample (``tokens == 1``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: The reductions a loop can choose from, in the words of the loop checker (:mod:`gas_lab.check`):
#: what the window's loss is, and so what each micro-batch's summed loss is divided by.
REDUCTIONS = ("microbatch-mean", "sequence", "token")
#: The bug, kept by name so lessons can measure it: each micro-batch's mean, *not* divided by N,
#: so the window's loss is the sum of the micro-batch means (named as ``"token-sum"`` is: what is
#: summed, then ``-sum``).
FORGOT_DIVIDE = "microbatch-mean-sum"

LossFn = Callable[[nn.Module, "Batch"], Tensor]
Grads = dict[str, Tensor]


# ---------------------------------------------------------------- batches and splitting
@dataclass
class Batch:
    """Inputs ``x``, targets ``y`` and, for sequences, ``mask`` (1 = real token, 0 = padding)."""

    x: Tensor
    y: Tensor
    mask: Tensor | None = None

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, rows: slice) -> Batch:
        mask = None if self.mask is None else self.mask[rows]
        return Batch(self.x[rows], self.y[rows], mask)

    @property
    def n_tokens(self) -> int:
        """Real loss terms: real tokens with a mask, else one per sample."""
        return len(self) if self.mask is None else int(self.mask.sum())


def ragged_sizes(batch_size: int, micro_batch_size: int) -> list[int]:
    """Full micro-batches, then whatever is left: ``ragged_sizes(10, 4) == [4, 4, 2]``."""
    sizes = [micro_batch_size] * (batch_size // micro_batch_size)
    return sizes + ([batch_size % micro_batch_size] if batch_size % micro_batch_size else [])


def even_sizes(batch_size: int, n_micro: int) -> list[int]:
    """N sizes that differ by at most one: ``even_sizes(10, 3) == [4, 3, 3]``."""
    q, r = divmod(batch_size, n_micro)
    return [q + 1] * r + [q] * (n_micro - r)


def split_batch(batch: Batch, sizes: int | Sequence[int]) -> list[Batch]:
    """Split into micro-batches: ``sizes=N`` gives N equal ones, a list gives those sizes."""
    if isinstance(sizes, int):
        if len(batch) % sizes:
            raise ValueError(
                f"{len(batch)} samples do not split into {sizes} equal micro-batches; pass "
                f"explicit sizes, e.g. even_sizes({len(batch)}, {sizes}) = "
                f"{even_sizes(len(batch), sizes)}"
            )
        sizes = [len(batch) // sizes] * sizes
    if sum(sizes) != len(batch) or min(sizes) < 1:
        raise ValueError(f"sizes {list(sizes)} must be positive and sum to {len(batch)}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [batch[s : s + n] for s, n in zip(starts, sizes, strict=True)]


# ---------------------------------------------------------------- the reductions
@dataclass(frozen=True)
class Window:
    """What a whole accumulation window holds; counted *before* the first backward."""

    n_micro: int
    n_samples: int
    n_tokens: int

    @classmethod
    def of(cls, micro_batches: Sequence[Batch]) -> Window:
        return cls(
            len(micro_batches),
            sum(len(mb) for mb in micro_batches),
            sum(mb.n_tokens for mb in micro_batches),
        )


def normalized_loss(
    token_losses: Tensor, mask: Tensor | None, reduction: str, window: Window
) -> Tensor:
    """The scalar one micro-batch contributes, so the window's sum is the intended loss.

    - ``microbatch-mean``: this micro-batch's mean over its own tokens, divided by N. Right only
      when every micro-batch holds the same number of real tokens.
    - ``sequence``: each sample's mean over its tokens, summed, divided by the window's
      sample count (every sample weighs the same, however long).
    - ``token``: summed token losses divided by the window's real-token count (every
      token weighs the same, as in one big padded batch).
    - ``microbatch-mean-sum`` (:data:`FORGOT_DIVIDE`): the bug, this micro-batch's mean alone.
    """
    m = torch.ones_like(token_losses) if mask is None else mask.to(token_losses.dtype)
    lm = token_losses * m  # padding's losses become 0
    loss_of = {  # each computed only when chosen
        "microbatch-mean": lambda: lm.sum() / m.sum() / window.n_micro,
        # each sample's mean over its real tokens (clamp: a sample with none gives 0, not 0/0)
        "sequence": lambda: (lm.sum(1) / m.sum(1).clamp(min=1)).sum() / window.n_samples,
        "token": lambda: lm.sum() / window.n_tokens,
        FORGOT_DIVIDE: lambda: lm.sum() / m.sum(),
    }
    if reduction not in loss_of:
        raise ValueError(f"unknown reduction {reduction!r}; choose from {', '.join(loss_of)}")
    return loss_of[reduction]()


# ---------------------------------------------------------------- gradients
def grads_of(model: nn.Module) -> Grads:
    """A detached copy of every parameter's ``.grad`` (zeros where backward never reached)."""
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for n, p in model.named_parameters()
    }


def accumulate_gradients(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    loss_fn: LossFn,
    reduction: str = "microbatch-mean",
) -> Grads:
    """Run forward + backward on each micro-batch and return the summed gradient."""
    window = Window.of(micro_batches)  # "token" needs the whole window's count up front
    # Zero once, *before* the loop: zeroing inside it would erase all but the last micro-batch.
    model.zero_grad(set_to_none=True)
    for mb in micro_batches:
        loss = normalized_loss(loss_fn(model, mb), mb.mask, reduction, window)
        loss.backward()  # .grad += d(loss)/d(param): this addition *is* the accumulation
    return grads_of(model)


def full_batch_gradient(
    model: nn.Module, batch: Batch, loss_fn: LossFn, reduction: str = "token"
) -> Grads:
    """The reference: one forward + backward on the whole batch (a window of one)."""
    return accumulate_gradients(model, [batch], loss_fn, reduction)


@dataclass(frozen=True)
class GradDiff:
    """How far two gradients are apart.

    ``max_rel`` divides each tensor's largest error by that tensor's largest reference entry,
    so a reference entry that happens to be ~0 cannot blow it up.
    """

    max_abs: float
    max_rel: float

    def __str__(self) -> str:
        return f"max abs diff {self.max_abs:.2e}, max rel diff {self.max_rel:.2e}"


def compare_grads(got: Grads, ref: Grads) -> GradDiff:
    """Compare two gradient dicts (same keys) in float64."""
    if got.keys() != ref.keys():
        raise KeyError(f"different parameters: {sorted(got)} vs {sorted(ref)}")
    abs_, rel = 0.0, 0.0
    for name, r in ref.items():
        err = (got[name].double() - r.double()).abs().max().item()
        abs_ = max(abs_, err)
        rel = max(rel, err / max(r.double().abs().max().item(), 1e-30))
    return GradDiff(abs_, rel)


# ---------------------------------------------------------------- loss functions
def mse_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Per-sample squared error, shape ``(batch, 1)``."""
    return (model(batch.x) - batch.y).pow(2).mean(dim=1, keepdim=True)


def token_losses(model: nn.Module, batch: Batch) -> Tensor:
    """Per-token cross-entropy, shape ``(batch, tokens)``; padding is masked later."""
    logits = model(batch.x)
    losses = F.cross_entropy(logits.flatten(0, 1), batch.y.flatten(), reduction="none")
    return losses.view_as(batch.y)


# ---------------------------------------------------------------- a training loop
def train_one_device(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Batch],
    n_micro: int,
    loss_fn: LossFn = mse_loss,
    reduction: str = "microbatch-mean",
    max_grad_norm: float | None = None,
    grad_norms: list[float] | None = None,
) -> list[float]:
    """One optimizer step per batch, accumulated over ``n_micro`` micro-batches.

    Returns the full-batch per-token loss measured *before* each step. If ``grad_norms`` is a
    list, the accumulated gradient's norm (before clipping) is appended to it at every step.
    """
    losses = []
    for batch in batches:
        with torch.no_grad():
            tl = loss_fn(model, batch)
            losses.append(normalized_loss(tl, batch.mask, "token", Window.of([batch])).item())
        grads = accumulate_gradients(model, split_batch(batch, n_micro), loss_fn, reduction)
        if grad_norms is not None:
            grad_norms.append(
                torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()])).item()
            )
        if max_grad_norm is not None:  # clipping sees the *accumulated* gradient, once per window
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
    return losses
