"""Stage ``paged-vectorized``: the gather becomes one advanced-indexing op per layer.

``paged-loop`` pays for its gather in Python: a slice and a copy per layer, request and block,
thousands of tiny ops per step whose cost is the interpreter and the op dispatch, not the bytes
moved. Here the step first computes a *slot mapping*, the pool slot behind every dense column,
from the block tables with a few tensor ops; each layer's history is then a single indexing op,
what ``pool[layer][:, slot_mapping]`` means. Everything else is inherited.

It is written as ``index_select`` over the flattened slot mapping rather than as that
advanced-indexing expression. Both give the same tensor, but each slot is a contiguous
``kv_heads x head_dim`` row, and ``index_select`` copies such rows whole, while advanced
indexing on a CPU computes an offset per element: for SmolLM2-sized layers the
expression is the slower of the two (chapter 03's notebook measures both on the reader's
machine).
"""

from __future__ import annotations

import torch

from .paged_loop import DecodeBatch, DenseKV, PagedLoopEngine


class PagedVectorizedEngine(PagedLoopEngine):
    name = "paged-vectorized"
    summary = "paged KV cache, one advanced-indexing gather per layer"

    def dense_slot_mapping(self, batch: DecodeBatch, width: int) -> torch.Tensor:
        """``[B, width]`` pool slot of every dense column, for all layers at once. A padding
        column reads its request's first token: attention masks it, so any finite value would
        do, and a real slot keeps the index in range."""
        block_manager = self.kv_cache.block_manager
        block_size = self.kv_cache.block_size
        # Each row: its padding width, then its block table. One host-to-device copy per step.
        rows = [[batch.history_len - block_manager.num_tokens[rid],
                 *block_manager.block_tables[rid]] for rid in batch.request_ids]
        # One spare column keeps a lookup one token past a full last block in range.
        cols = max(map(len, rows)) + 1
        packed = torch.tensor([row + [0] * (cols - len(row)) for row in rows], device=self.device)
        pad_lens, block_tables = packed[:, :1], packed[:, 1:]
        token = (torch.arange(width, device=self.device) - pad_lens).clamp(min=0)
        return block_tables.gather(1, token // block_size) * block_size + token % block_size

    def gather_batch_kv(self, batch: DecodeBatch) -> DenseKV:
        slot_mapping = self.dense_slot_mapping(batch, batch.history_len)
        out = []
        shape = (2, *slot_mapping.shape, self.kv_cache.kv_heads, self.kv_cache.head_dim)
        flat = slot_mapping.flatten()
        for layer_slots in self.kv_cache.slots:  # [2, num_slots, kv_heads, head_dim]
            dense = torch.index_select(layer_slots, 1, flat).view(shape)  # [2, B, L, kvh, hd]
            dense = dense.transpose(2, 3)  # [2, B, kv_heads, L, head_dim], as HF's cache holds it
            out.append((dense[0], dense[1]))
        return out
