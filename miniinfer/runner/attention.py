"""How attention finds K/V in the paged pool: the metadata every layer's attention receives.

Chapter 06 introduced it. A forward over a batch's new tokens, flattened into one sequence
``[T]`` with each token's position, needs per layer: the pool's K/V views, each request's block
table and context length, the slot each new token's K/V goes to, and, for prompt chunks, where
each request's queries start (``cu_seqlens_q``). :class:`PagedAttentionMetadata` carries them
and has ``attend``: store the new K/V, then run the backend's decode or varlen kernel.
:class:`MixedBatchMetadata` (chapter 08) splits one forward into its decode rows and its chunk
rows, each part with its own metadata.

Both forwards of :class:`~miniinfer.runner.ModelRunner` take it: our own
(:mod:`miniinfer.runner.direct`) calls ``attend`` itself; HF's module tree finds
:func:`paged_attention_forward` through transformers' ``AttentionInterface`` under the name
``"miniinfer_paged"`` and gets the metadata as a keyword argument it hands down untouched.
The name is left out of ``AttentionMaskInterface`` on purpose: for an implementation unknown
to it, ``create_causal_mask`` returns None at once, so no dense mask is built.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel

from ..core.errors import MiniInferError
from ..core.kernels import BACKENDS, AttentionBackend, DecodeFn, available_backends, get_backend
from ..core.ranges import phase
from .step import StepBatch

ATTN_IMPLEMENTATION = "miniinfer_paged"


@dataclass(slots=True)
class PagedAttentionMetadata:
    """What every layer's attention needs for one forward over the flattened new tokens."""

    # Per layer, its (k_cache, v_cache) [num_blocks, block_size, kv_heads, head_dim].
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0
    context_lens: torch.Tensor  # int32 [B], cached tokens including this forward's new ones
    slot_mapping: torch.Tensor  # int64 [total_tokens], the slot of each new token's K/V
    backend: AttentionBackend
    cu_seqlens_q: torch.Tensor | None = None  # int32 [B + 1]; None: one new token per request
    max_seqlen_q: int = 1
    # A bound on context_lens known on the host (None: a plan that needs one reads it back).
    max_context_len: int | None = None
    decode_run: DecodeFn | None = None  # the backend's decode plan, made by the first layer

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """One layer's attention for this forward's new tokens, ``[T, heads, head_dim]`` in and
        out (``k``, ``v``: ``[T, kv_heads, head_dim]``, RoPE applied): store their K/V in their
        slots, then run the varlen kernel (prefill: whole prompts, causal) or the decode kernel
        (one token per request)."""
        k_cache, v_cache = self.kv[layer_idx]
        decode = self.cu_seqlens_q is None
        with phase("write_decode_kv" if decode else "write_prefill_kv"):
            self.backend.store_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if decode:
            return self.decode(q, k_cache, v_cache, scale)
        return self.backend.varlen(q, k_cache, v_cache, self.cu_seqlens_q, self.block_tables,
                                   self.context_lens, scale, self.max_seqlen_q)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """The backend's decode over this step's block tables and context lens. Where the
        backend splits decode into plan and run, the first layer plans for all the others."""
        backend = self.backend
        if backend.plan_decode is None:
            return backend.decode(q, k_cache, v_cache, self.block_tables, self.context_lens,
                                  scale)
        if self.decode_run is None:
            self.decode_run = backend.plan_decode(self.block_tables, self.context_lens,
                                                  k_cache.shape[1], self.max_context_len)
        return self.decode_run(q, k_cache, v_cache, scale)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float, dropout: float = 0.0,
                            paged_attention: PagedAttentionMetadata | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``[1, heads, T, head_dim]`` and
    ``key``/``value`` ``[1, kv_heads, T, head_dim]`` (RoPE applied) for the ``T`` new tokens;
    returns ``[1, T, heads, head_dim]`` like ``sdpa_attention_forward``, and no weights.
    ``paged_attention`` is anything with ``attend`` (chapter 08's mixed batches too)."""
    if paged_attention is None:
        raise MiniInferError(f"attention {ATTN_IMPLEMENTATION!r} needs the paged_attention "
                             f"metadata that miniinfer's paged engines pass to the model")
    # The kernels take one row per token: [T, heads, head_dim] (a view, no copy).
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = paged_attention.attend(module.layer_idx, q, k, v, scaling)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


@contextmanager
def attn_implementation(model: PreTrainedModel, name: str) -> Iterator[None]:
    """Run ``model`` with attention ``name``, restoring the previous one however the block
    ends (the model is shared with the other engines of its ``LoadedModel``)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def has_sliding_window(config) -> bool:
    """Whether any layer attends to a sliding window only (Mistral, some Qwen2 configs)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return getattr(config, "sliding_window", None) is not None


@dataclass(slots=True)
class MixedBatchMetadata:
    """One step's forward: the first ``num_decodes`` tokens are decodes (one per request), the
    rest prompt chunks; each part carries chapter 06's metadata, or None when the step has none
    of that kind. It has chapter 06's ``attend``, so it goes wherever that metadata goes: to
    the direct forward, or down HF's modules to the registered paged attention."""

    num_decodes: int
    decodes: PagedAttentionMetadata | None
    chunks: PagedAttentionMetadata | None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Chapter 06's ``attend`` on the decode rows and on the chunk rows separately
        (``[T, heads, head_dim]`` in and out)."""
        n = self.num_decodes
        parts = [meta.attend(layer_idx, q[rows], k[rows], v[rows], scale)
                 for meta, rows in ((self.decodes, slice(None, n)), (self.chunks, slice(n, None)))
                 if meta is not None]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(slots=True)
class PagedAttention:
    """Attention over a paged pool, for the eager forwards: the backend decodes run with, the
    one prompt chunks run with (flash-attn only decodes, so prompts then go to the best backend
    with a varlen kernel), and :meth:`prepare`, which turns a step batch into the metadata
    every layer's ``attend`` reads."""

    kv: Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    backend: AttentionBackend
    prefill_backend: AttentionBackend

    @classmethod
    def over(cls, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
             block_size: int, name: str | None = None) -> PagedAttention:
        """Backend ``name`` (None: the best available) over ``kv``."""
        backend = get_backend(name, device, block_size, head_dim=kv[0][0].shape[-1])
        prefill = backend if backend.varlen else next(
            BACKENDS[other] for other in available_backends(device, block_size)
            if BACKENDS[other].varlen)
        return cls(kv, backend, prefill)

    def prepare(self, batch: StepBatch) -> PagedAttentionMetadata | MixedBatchMetadata:
        """The step's attention metadata: chapter 06's for a batch of one kind, chapter 08's
        two parts for decodes followed by chunks."""
        n = batch.num_decodes
        decodes = PagedAttentionMetadata(
            self.kv, batch.block_tables[:n], batch.context_lens[:n], batch.slot_mapping[:n],
            self.backend, max_context_len=batch.max_context_len) if n else None
        chunks = PagedAttentionMetadata(
            self.kv, batch.block_tables[n:], batch.context_lens[n:], batch.slot_mapping[n:],
            self.prefill_backend, cu_seqlens_q=batch.query_starts,
            max_seqlen_q=batch.max_query_len) if batch.num_chunks else None
        if chunks is None or decodes is None:
            return decodes or chunks
        return MixedBatchMetadata(n, decodes, chunks)
