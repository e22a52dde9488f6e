"""The checker's two models: its toy (the default) and a tiny transformers causal LM (``hf``).

Both accept a micro-batch as trainers pass it, ``model(**micro_batch)``, and ignore the keys they
do not use (``loss_mask``, and anything else a loop adds); both are seeded, so every rank and the
reference build the same weights.

* ``toy``: :class:`ToyLM`, embedding -> tanh(linear) -> vocabulary logits, one prediction per
  position. However it is called (``model(input_ids)`` or ``model(**micro_batch)``) it returns
  the logits tensor ``[B, T, V]``, and ``labels[b, t]`` is the target of ``logits[b, t]`` (no
  shift). It ignores ``attention_mask`` and ``position_ids``: each position sees only its token.
* ``hf``: :class:`HFCausalLM`, transformers' ``LlamaForCausalLM`` built from a config (vocabulary
  16, hidden size 16, one layer; no download), called as transformers' models are: it returns
  their ``CausalLMOutputWithPast`` (``out.logits``; ``out.loss`` when ``labels`` are given, a
  mean over the targets, or their sum over ``num_items_in_batch`` when that is given), and it
  shifts the labels (``logits[b, t - 1]`` predicts ``labels[b, t]``). Its logits depend on
  ``position_ids`` (rotary positions): a loop that calls it without them on packed rows computes
  other logits than the reference, which passes the micro-batch as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from gas_lab.check.cases import VOCAB
from gas_lab.toys import TinySeqModel

MODELS = ("toy", "hf")
CONVENTION = {"toy": "toy", "hf": "hf"}  # the labels' convention each model follows


class ToyLM(nn.Module):
    """The toy's language model (:class:`~gas_lab.toys.TinySeqModel`), taking a micro-batch."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.net = TinySeqModel(seed, vocab=VOCAB)

    def forward(self, input_ids=None, **ignored) -> torch.Tensor:
        return self.net(input_ids)


def transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


class HFCausalLM(nn.Module):
    """A tiny ``LlamaForCausalLM`` built from a config, called as a transformers model is."""

    KEYS = ("input_ids", "attention_mask", "position_ids", "labels", "num_items_in_batch")

    def __init__(self, seed: int = 0):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            # larger than transformers' 0.02, so one SGD step moves every weight by a visible
            # fraction: a mistake of 1 % in the loss weights stays far above rounding
            initializer_range=0.5,
            use_cache=False,
        )
        config._attn_implementation = "eager"  # the same arithmetic in every process
        torch.manual_seed(seed)
        self.lm = LlamaForCausalLM(config)

    def forward(self, input_ids=None, **kwargs):
        used = {k: v for k, v in kwargs.items() if k in self.KEYS and v is not None}
        return self.lm(input_ids=input_ids, use_cache=False, **used)


def build(model: str, seed: int = 0) -> nn.Module:
    if model == "toy":
        return ToyLM(seed)
    if model == "hf":
        return HFCausalLM(seed)
    raise ValueError(f"model {model!r}: choose from {', '.join(MODELS)}")


def logits_of(model: str, net: nn.Module, mb: dict) -> torch.Tensor:
    """The logits the reference computes for a micro-batch: the micro-batch as it is."""
    out = net(**{k: mb[k] for k in ("input_ids", "attention_mask", "position_ids")})
    return out if model == "toy" else out.logits


def target_losses(model: str, net: nn.Module, mb: dict) -> torch.Tensor:
    """Cross-entropy per target, laid out as ``labels`` ([B, T]; 0 where no target): under
    transformers' convention the loss of ``labels[b, t]`` comes from ``logits[b, t - 1]``."""
    logits = logits_of(model, net, mb).float()
    labels = mb["labels"]
    if CONVENTION[model] == "hf":
        logits, labels = logits[:, :-1], labels[:, 1:]
    ce = nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none"
    ).view(labels.shape)
    if CONVENTION[model] == "hf":
        ce = torch.cat([torch.zeros_like(ce[:, :1]), ce], dim=1)
    return ce
