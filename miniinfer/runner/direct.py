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
The tokens stay one flat sequence ``[T]``, and attention is whatever the metadata says
(``attend``), so the same forward serves prefill, decode and chapter 08's mixed batches.
Chapter 11 compiles the same model and chapter 12 shards it; neither has a forward of its own.

Only architectures whose layers are exactly this are supported (:func:`unsupported_reason`);
anything else runs HF's modules through the registry.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .model import Model, PagedAttend, load, unsupported_reason

__all__ = ["DirectForward", "PagedAttend", "unsupported_reason"]


class DirectForward:
    """``forward(input_ids [T], position_ids [T], metadata, logits_rows=None)`` -> logits of
    the rows ``logits_rows`` picks (None: every token), ``[rows, vocab]``. ``model``: an HF
    model (its :class:`Model` is built once and shared) or a :class:`Model` itself."""

    def __init__(self, model: PreTrainedModel | Model) -> None:
        self.model = model if isinstance(model, Model) else load(model)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 metadata: PagedAttend, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.model.rope(position_ids)
        hidden = self.model.body(input_ids, cos, sin, metadata.attend)
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        return self.model.head(hidden)
