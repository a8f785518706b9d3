"""Stage ``paged-prealloc``: no allocation, no ``cat`` and no per-request tensor ops per step.

After ``paged-vectorized`` the step still allocates a fresh dense tensor per layer, copies it
again when ``DynamicCache`` concatenates it and once more when the forward appends the new token,
and writes the new K/V back with a slice and a copy per layer and request. Here:

- one buffer, kept by the engine and grown only when a generate call needs more, holds the
  step's dense K/V of all layers, with a free column at the end for the token the step feeds;
- one ``index_select(..., out=buffer)`` gathers all layers into it;
- the cache hands the model views of the buffer, and the forward's "append" writes the new K/V
  into the free column instead of concatenating;
- one ``index_copy_`` writes the new token's K/V of every layer and request into the pool.

The variant ``paged-prealloc:per-request`` keeps the buffer but writes the new K/V back as
``paged-vectorized`` does (a copy per layer and request), so chapter 04 can measure the buffer
and the batched write apart.
"""

from __future__ import annotations

import math

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from ..core.errors import UnknownNameError
from ..core.models import LoadedModel
from ..core.sampling import SamplingParams
from .paged_loop import DecodeBatch, DenseKV, PagedLoopEngine
from .paged_vectorized import PagedVectorizedEngine


class BufferLayer(DynamicLayer):
    """A cache layer over views ``[B, kv_heads, L + 1, head_dim]`` of the gather buffer whose
    last column is free: ``update`` fills it with the step's new K/V, where ``DynamicLayer``
    would allocate a ``torch.cat`` of history and new token."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.full = (keys, values)
        # Until update, the layer holds the history only (the mask sizes are read from it).
        self.keys, self.values = keys[:, :, :-1], values[:, :, :-1]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = self.full
        self.keys[:, :, -1:] = key_states
        self.values[:, :, -1:] = value_states
        return self.keys, self.values


# How the decode step's new K/V goes back to the pool: one index_copy_ for every layer and
# request ("batched", the stage), or a copy per layer and request as before ("per-request").
KV_WRITES = ("batched", "per-request")


class PagedPreallocEngine(PagedVectorizedEngine):
    name = "paged-prealloc"
    summary = "paged KV cache, reused gather buffer, one-op KV writes, no cat"
    variant_option = "kv_write"
    variants = KV_WRITES

    def __init__(self, lm: LoadedModel, kv_write: str = "batched",
                 **kv_options: int | None) -> None:
        if kv_write not in KV_WRITES:
            raise UnknownNameError(f"unknown kv_write {kv_write!r}; choose from "
                                   f"{', '.join(KV_WRITES)}")
        super().__init__(lm, **kv_options)
        self.kv_write = kv_write
        self.gather_buffer = torch.empty(0, dtype=lm.dtype, device=lm.device)

    def prefill(self, request_ids: list[int], prompts: list[list[int]],
                params: SamplingParams) -> tuple[DecodeBatch, torch.Tensor]:
        batch, logits = super().prefill(request_ids, prompts, params)
        # Sized for this call's last step (the mask is as wide as history + free column get).
        numel = math.prod(self.dense_shape(batch, batch.attention_mask.shape[1]))
        if self.gather_buffer.numel() < numel:
            self.gather_buffer = torch.empty(numel, dtype=self.lm.dtype, device=self.device)
        return batch, logits

    def dense_shape(self, batch: DecodeBatch, width: int) -> tuple[int, ...]:
        kv_cache = self.kv_cache
        return (kv_cache.num_layers, 2, len(batch.request_ids), width, kv_cache.kv_heads,
                kv_cache.head_dim)

    def dense_view(self, batch: DecodeBatch) -> torch.Tensor:
        """This step's part of the buffer: ``[num_layers, 2, B, L + 1, kv_heads, head_dim]``,
        token-major like the pool, so one ``index_select`` over slots fills it."""
        shape = self.dense_shape(batch, batch.history_len + 1)
        return self.gather_buffer[: math.prod(shape)].view(shape)

    def write_prefill_kv(self, batch: DecodeBatch, cache: Cache) -> None:
        slot_mapping = self.dense_slot_mapping(batch, batch.history_len).flatten()
        # Dense columns that hold prompt tokens; padding columns have no slot of their own.
        real = batch.attention_mask[:, : batch.history_len].flatten().nonzero().squeeze(1)
        prompt_slots = slot_mapping[real]
        for layer_slots, cache_layer in zip(self.kv_cache.slots, cache.layers, strict=True):
            dense = torch.stack((cache_layer.keys, cache_layer.values)).transpose(2, 3)
            layer_slots.index_copy_(1, prompt_slots, dense.flatten(1, 2)[:, real])

    def gather_batch_kv(self, batch: DecodeBatch) -> DenseKV:
        dense = self.dense_view(batch)
        # The free column gathers whatever its slot holds; the forward overwrites it.
        slot_mapping = self.dense_slot_mapping(batch, batch.history_len + 1)
        torch.index_select(self.kv_cache.slots, 2, slot_mapping.flatten(), out=dense.flatten(2, 3))
        dense = dense.transpose(3, 4)  # [num_layers, 2, B, kv_heads, L + 1, head_dim]
        return list(zip(dense[:, 0], dense[:, 1], strict=True))

    def build_cache(self, dense: DenseKV) -> Cache:
        return Cache(layers=[BufferLayer(keys, values) for keys, values in dense])

    def write_decode_kv(self, batch: DecodeBatch, cache: Cache) -> None:
        if self.kv_write == "per-request":
            # The buffer's last column is what the cache layers' keys/values end in.
            return PagedLoopEngine.write_decode_kv(self, batch, cache)
        block_manager = self.kv_cache.block_manager
        for rid in batch.request_ids:
            block_manager.append(rid)
        new_slots = torch.tensor(
            [block_manager.slot(rid, block_manager.num_tokens[rid] - 1)
             for rid in batch.request_ids], device=self.device)
        new_kv = self.dense_view(batch)[:, :, :, -1]  # [num_layers, 2, B, kv_heads, head_dim]
        self.kv_cache.slots.index_copy_(2, new_slots, new_kv)
