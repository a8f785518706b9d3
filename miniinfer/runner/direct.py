"""Chapter 06's direct forward: our own model definition run eagerly, step by step.

Through transformers' attention registry, every decode step runs HF's whole module tree: per
layer a dozen ``nn.Module`` calls (each through ``__call__`` and its hook checks), keyword
arguments threaded through every level, output dataclasses, and our attention adapter turning
``[1, heads, T, dim]`` into the kernels' ``[T, heads, dim]`` and back. On a GPU that host time
hides behind the device (and chapter 07's CUDA graphs remove it). On a CPU it is on the critical
path, next to matmuls of only a few tokens.

:class:`DirectForward` runs :class:`~miniinfer.runner.model.Model` instead: the same
computation (embedding, then per layer RMSNorm, the fused q/k/v projection, RoPE, paged
attention, the output projection, RMSNorm and the gated MLP, then the final norm and the LM
head) written as a few small modules that own their weights, built once from HF's state dict.
The tokens stay one flat sequence ``[T]`` (a :class:`~miniinfer.runner.step.StepBatch`), and
attention is whatever the metadata made from it says (``attend``), so the same forward serves
prefill, decode and chapter 08's mixed batches.
Chapter 11 compiles the same model and chapter 12 shards it; neither has a forward of its own.

Only architectures whose layers are exactly this are supported (:func:`unsupported_reason`);
anything else runs HF's modules through the registry.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .attention import PagedAttention
from .model import Model, PagedAttend, load, unsupported_reason
from .step import StepBatch

__all__ = ["DirectForward", "PagedAttend", "unsupported_reason"]


class DirectForward:
    """``forward(batch)`` -> logits of the rows ``batch.logits_rows`` picks (None: every
    token), ``[rows, vocab]``, attending through ``attention`` (its metadata made from the
    batch). ``model``: an HF model (its :class:`Model` is built once and shared) or a
    :class:`Model` itself."""

    def __init__(self, model: PreTrainedModel | Model, attention: PagedAttention) -> None:
        self.model = model if isinstance(model, Model) else load(model)
        self.attention = attention

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        metadata = self.attention.prepare(batch)
        cos, sin = self.model.rope(batch.positions)
        hidden = self.model.body(batch.input_ids, cos, sin, metadata.attend)
        if batch.logits_rows is not None:
            hidden = hidden[batch.logits_rows]
        return self.model.head(hidden)
