"""A forward of our own for the Llama/Qwen2 family, over the HF model's own weights (chapter 06).

Through transformers' attention registry, every decode step runs HF's whole module tree: per
layer a dozen ``nn.Module`` calls (each through ``__call__`` and its hook checks), keyword
arguments threaded through every level, output dataclasses, and our attention adapter turning
``[1, heads, T, dim]`` into the kernels' ``[T, heads, dim]`` and back. On a GPU that host time
hides behind the device (and chapter 07's CUDA graphs remove it). On a CPU it is on the critical
path, next to matmuls of only a few tokens: timing single batch-8 decode forwards on our 2-core
CPU, HF's modules with our attention took 2-9% longer than HF's own forward with its dense
cache (chapter 06's benchmark has both forwards).

:class:`DirectForward` is the same computation written out: embedding, then per layer RMSNorm,
the q/k/v projections, RoPE, paged attention, the output projection, RMSNorm and the gated MLP,
then the final norm and the LM head. It calls the same ops on the same weight tensors in the
same order as HF's modules (the norms, rotary embedding and activation *are* HF's, called
directly), so its logits are bit for bit HF's; only the Python around them is gone. The tokens
stay one flat sequence ``[T]``, and attention is whatever the metadata says (``attend``), so the
same forward serves prefill, decode and chapter 08's mixed batches.

Only architectures whose layers are exactly this are supported (:func:`unsupported_reason`);
anything else runs HF's modules through the registry.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


class PagedAttend(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Store the new tokens' K/V and attend: ``[T, heads, dim]`` in and out."""


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why :class:`DirectForward` cannot run ``model`` (None: it can)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model type {config.model_type!r} is not one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "it splits its projections (pretraining_tp > 1)"
    return None


class DirectForward:
    """``forward(input_ids [T], position_ids [T], metadata, logits_rows=None)`` -> logits of
    the rows ``logits_rows`` picks (None: every token), ``[rows, vocab]``."""

    def __init__(self, model: PreTrainedModel) -> None:
        # References to HF's weights and modules, not copies: the model stays shared.
        self.embed = model.model.embed_tokens.weight
        self.rotary = model.model.rotary_emb
        self.layers = model.model.layers
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        attention = self.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.scale = attention.scaling

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 metadata: PagedAttend, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden]
        # [1, T, dim] as HF computes them; [T, 1, dim] broadcasts over the heads of [T, heads, dim].
        cos, sin = self.rotary(hidden[None], position_ids[None])
        cos, sin = cos[0, :, None], sin[0, :, None]
        dim = self.head_dim
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm.forward(hidden)
            tokens = x.shape[0]
            q = _linear(x, attn.q_proj).view(tokens, -1, dim)
            k = _linear(x, attn.k_proj).view(tokens, -1, dim)
            v = _linear(x, attn.v_proj).view(tokens, -1, dim)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            out = metadata.attend(i, q, k, v, self.scale)
            hidden = hidden + _linear(out.reshape(tokens, -1), attn.o_proj)
            x = layer.post_attention_layernorm.forward(hidden)
            mlp = layer.mlp
            hidden = hidden + _linear(
                mlp.act_fn(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj), mlp.down_proj)
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        return _linear(self.norm.forward(hidden), self.lm_head)


def _linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` for one tensor: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)
