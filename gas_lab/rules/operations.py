"""The engine's calls, named once: what the rules check, the matrix measures and lesson 06 asks.

A script of **ops** is what a training loop does after ``initialize``, named as in DeepSpeed's
measured matrix (``data/deepspeed_0.19.8_matrix.json``). Each :class:`Call` says, for one op:

* ``call``: the engine call it is, the name a rule's ``action`` and a learner's answer use
  (``"step"``, ``"no_sync"``, ``"loss.backward"``, ...);
* ``checked``: whether a rule keyed to the call is evaluated there: everywhere but on leaving a
  with-block (a rule about ``no_sync()`` fires on entering it);
* ``moment``: when a refusal there happens: ``"initialize"``, ``"call"`` (a method) or
  ``"context"`` (entering a with-block);
* ``label``: how a learner reads the op in a script;
* ``perform(engine, script)``: how to do it, on gas_lab's engine or DeepSpeed's alike.

:func:`perform` runs a script of ops on an engine (the matrix, the rules' examples);
:func:`situation_action` is what the engine and :mod:`gas_lab.measure.prediction` hand a rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from gas_lab.toys import micro_batch, tiny_model


@dataclass
class Script:
    """What a running script of ops keeps: the next micro-batch, the open with-blocks."""

    micro: int = 0
    contexts: list = field(default_factory=list)

    def batch(self, engine):
        """The next micro-batch of this rank, in the model's dtype (bf16 engines cast it)."""
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        dtype = next(engine.module.parameters()).dtype
        size = engine.train_micro_batch_size_per_gpu()
        x, y = (t.to(dtype) for t in micro_batch(0, 0, self.micro, rank, size))
        self.micro += 1
        return x, y


@dataclass(frozen=True)
class Call:
    """One op of a script: the engine call it is, whether and when DeepSpeed checks it there,
    how a learner reads it, and how to perform it."""

    op: str
    call: str
    checked: bool
    moment: str
    label: str
    perform: Callable[[object, Script], object] = field(repr=False, compare=False)


def _backward(engine, script: Script):
    x, y = script.batch(engine)
    return engine.backward(torch.nn.functional.mse_loss(engine(x), y))


def _tensor_backward(engine, script: Script):
    x, y = script.batch(engine)
    return torch.nn.functional.mse_loss(engine(x), y).backward()


def _train_batch(engine, script: Script):
    x, y = script.batch(engine)
    return engine.train_batch(data_iter=iter([(x, y)] * engine.gradient_accumulation_steps()))


def _enter(name: str):
    def enter(engine, script: Script):
        block = getattr(engine, name)()
        block.__enter__()
        script.contexts.append(block)

    return enter


def _leave(engine, script: Script):
    script.contexts.pop().__exit__(None, None, None)


CALLS: dict[str, Call] = {
    c.op: c
    for c in (
        Call("initialize", "initialize", True, "initialize", "initialize()", lambda e, s: None),
        Call("backward", "backward", True, "call", "backward()", _backward),
        Call("tensor_backward", "loss.backward", True, "call", "loss.backward()", _tensor_backward),
        Call("step", "step", True, "call", "step()", lambda e, s: e.step()),
        Call(
            "set_boundary_true",
            "set_gradient_accumulation_boundary",
            True,
            "call",
            "set_gradient_accumulation_boundary(True)",
            lambda e, s: e.set_gradient_accumulation_boundary(True),
        ),
        Call(
            "set_boundary_false",
            "set_gradient_accumulation_boundary",
            True,
            "call",
            "set_gradient_accumulation_boundary(False)",
            lambda e, s: e.set_gradient_accumulation_boundary(False),
        ),
        Call("enter_no_sync", "no_sync", True, "context", "enter no_sync()", _enter("no_sync")),
        Call("exit_no_sync", "no_sync", False, "call", "leave no_sync()", _leave),
        Call(
            "enter_coalesce",
            "coalesce_grad_reduction",
            True,
            "context",
            "enter coalesce_grad_reduction()",
            _enter("coalesce_grad_reduction"),
        ),
        Call(
            "exit_coalesce",
            "coalesce_grad_reduction",
            False,
            "call",
            "leave coalesce_grad_reduction()",
            _leave,
        ),
        Call("train_batch", "train_batch", True, "call", "train_batch()", _train_batch),
    )
}

#: The engine calls a rule's ``action`` may name (and a learner's answer, with "accepted").
ACTIONS: tuple[str, ...] = tuple(dict.fromkeys(c.call for c in CALLS.values()))


def call_of(op: str) -> Call:
    """The :class:`Call` of ``op``; an unknown op is an error that lists the known ones."""
    if op not in CALLS:
        raise ValueError(f"unknown op {op!r}; the ops are {sorted(CALLS)}")
    return CALLS[op]


def situation_action(op: str) -> str | None:
    """What a rule's ``action`` must be to fire at ``op``; None where DeepSpeed checks none."""
    c = call_of(op)
    return c.call if c.checked else None


def model(pipeline: bool = False) -> torch.nn.Module:
    """The model a script runs on: the course's tiny MLP, or it as a one-stage DeepSpeed
    ``PipelineModule`` (2-way data parallel on 2 ranks)."""
    if not pipeline:
        return tiny_model(0)
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    if dist.is_initialized():  # a PipelineModule needs deepspeed.comm, which initialize starts
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    return PipelineModule(layers=list(tiny_model(0)), num_stages=1, loss_fn=torch.nn.MSELoss())


def perform(engine, ops: Iterable[str], script: Script | None = None) -> Script:
    """Run ``ops`` on ``engine`` in order (the with-blocks they enter stay open until an op
    leaves them); returns the script's state, so a caller may go on."""
    script = script if script is not None else Script()
    for op in ops:
        call_of(op).perform(engine, script)
    return script
