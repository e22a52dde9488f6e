"""The course's toy models and data, in one place: small, seeded, and the same on every rank.

* :func:`tiny_model` and :func:`micro_batch`: the MLP and the deterministic micro-batches of
  every multi-rank lesson (02-06) and of the parity checks against DeepSpeed. Any process can
  rebuild what every rank saw from ``(seed, step, micro-batch, rank)``.
* :func:`regression_mlp` with :func:`regression_batch`, and :class:`TinySeqModel` with
  :func:`sequence_batch` / :func:`spread_lengths`: lesson 01's one-device regression and
  padded-sequence tasks.
* :class:`TinyTransformer`: the capstone's model (lesson 07).
* :func:`wide_mlp`: a 1M-weight MLP with tiny_model's inputs and outputs (lesson 09's memory).
* :func:`flat_params`: every parameter as one vector, to compare models and ship them.
* :func:`one_thread`: torch on one thread while these models run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from gas_lab.accumulate import Batch

_NORMS = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm}


def tiny_model(
    seed: int = 0, d_in: int = 4, hidden: int = 8, d_out: int = 2, norm: str | None = None
) -> nn.Sequential:
    """Linear → [BatchNorm1d if norm="batch" | LayerNorm if "layer"] → tanh → Linear; seeded,
    so every rank that calls it with the same seed builds the same weights."""
    torch.manual_seed(seed)
    layers = [nn.Linear(d_in, hidden)]
    if norm is not None:
        layers.append(_NORMS[norm](hidden))
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(hidden, d_out))


def wide_mlp(seed: int = 0, width: int = 1024) -> nn.Sequential:
    """Two hidden layers of ``width`` (1,056,770 weights at 1024): lesson 09's model for memory
    measured at more than a toy's size. Same inputs and outputs as :func:`tiny_model`."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2)
    )


def micro_batch(seed: int, step: int, micro: int, rank: int, size: int, d_in=4, d_out=2):
    """Deterministic data: every (seed, step, micro-batch, rank) has its own fixed sample."""
    g = torch.Generator().manual_seed(((seed * 1000 + step) * 1000 + micro) * 1000 + rank)
    return torch.randn(size, d_in, generator=g), torch.randn(size, d_out, generator=g)


def regression_mlp(seed: int = 0, norm: str | None = None) -> nn.Sequential:
    """Lesson 01's model for :func:`regression_batch` (8 features in, 1 out)."""
    return tiny_model(seed, d_in=8, hidden=16, d_out=1, norm=norm)


def regression_batch(n: int, seed: int = 0, d_in: int = 8) -> Batch:
    """``y = x @ w + noise`` with a fixed ``w``; ``seed`` picks the samples."""
    w = torch.linspace(-1.0, 1.0, d_in).unsqueeze(1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    return Batch(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


class TinySeqModel(nn.Module):
    """Embedding → tanh(Linear) → vocabulary logits, one prediction per token; seeded."""

    def __init__(self, seed: int = 0, vocab: int = 16, dim: int = 8):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def sequence_batch(
    lengths: Sequence[int], max_len: int | None = None, seed: int = 0, vocab: int = 16
) -> Batch:
    """Random token sequences padded to ``max_len``; target = next token id (mod vocab)."""
    max_len = max_len or max(lengths)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (len(lengths), max_len), generator=g)
    mask = (torch.arange(max_len) < torch.tensor(lengths).unsqueeze(1)).long()
    return Batch(x * mask, (x + 1) % vocab * mask, mask)  # padding is token 0, target 0


def spread_lengths(n: int, max_len: int, spread: float) -> list[int]:
    """n lengths from ``max_len`` down to ``max_len * (1 - spread)``, longest first.

    Sorted on purpose: length-grouped samplers put similar lengths together, so micro-batches
    end up with very different token counts, the case where normalization matters most.
    """
    shortest = max(1, round(max_len * (1.0 - spread)))
    return [round(max_len - (max_len - shortest) * i / max(n - 1, 1)) for i in range(n)]


class TinyTransformer(nn.Module):
    """Token + position embedding, one pre-norm block (causal attention, MLP), logits; seeded."""

    def __init__(self, seed: int = 0, vocab: int = 16, dim: int = 16, max_len: int = 12):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No bias: a key bias shifts a whole row of scores, which softmax ignores; its gradient
        # is then float32 noise, which Adam would blow up into lr-sized random steps.
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        # Causal: a token sees only itself and earlier ones, so right-padding never leaks in.
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        h = h + self.proj(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v)
        return self.head(h + self.mlp(self.norm2(h)))


def flat_params(module: nn.Module) -> Tensor:
    """Every parameter as one detached float32 CPU vector (to compare and to ship)."""
    return torch.cat([p.detach().float().flatten().cpu() for p in module.parameters()])


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread: these models' tensors hold a few hundred elements, and on a busy
    2-core machine the threads of one op only wait for each other (a checker replay took 13
    times longer on 2 threads than on 1; a lesson 01 slider move, seconds)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
