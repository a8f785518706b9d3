"""Decode through flash-attn's paged KV cache kernel (``flash_attn_with_kvcache`` with a block
table), used when the ``flash_attn`` package imports and the device is a CUDA GPU.

Constraints of flash-attn 2 (``mha_fwd_kvcache`` in its ``csrc/flash_attn/flash_api.cpp``):

* the paged KV cache's block size must be a multiple of 256 ("Paged KV cache block size must be
  divisible by 256"), so the block size 16 that the book's block manager uses by default rules
  it out; :func:`unavailable_reason` says so when it is given the block size;
* Ampere (sm80) or newer, fp16/bf16 only, head_dim <= 256.

Only decode is wrapped: with several queries per request flash-attn's causal mask needs the
same query count in every request, which chunked prefill does not have.
"""

from __future__ import annotations

import torch

try:
    from flash_attn import flash_attn_with_kvcache
except (ImportError, OSError) as exc:  # a wheel built for another torch/CUDA fails to load
    flash_attn_with_kvcache = None
    _IMPORT_ERROR = f"flash_attn does not import ({exc})"

PAGE_BLOCK_MULTIPLE = 256


def unavailable_reason(device: torch.device, block_size: int | None = None) -> str | None:
    """Why flash-attn cannot run on ``device`` (None: it can)."""
    if flash_attn_with_kvcache is None:
        return _IMPORT_ERROR
    if device.type != "cuda":
        return f"flash-attn runs only on CUDA, not {device.type}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "flash-attn needs an Ampere (sm80) or newer GPU"
    if block_size is not None and block_size % PAGE_BLOCK_MULTIPLE:
        return (f"flash-attn's paged KV cache needs a block size that is a multiple of "
                f"{PAGE_BLOCK_MULTIPLE}, got {block_size}")
    return None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Same contract as :func:`.reference.paged_decode_attention`."""
    if reason := unavailable_reason(q.device, k_cache.shape[1]):
        raise RuntimeError(reason)
    # flash-attn wants [batch, seqlen_q, heads, dim]; cache_seqlens counts the new token, which
    # is already stored, exactly like our context lens.
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
                                  block_table=block_tables, softmax_scale=scale, causal=True)
    return out.squeeze(1)
