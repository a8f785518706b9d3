"""Paged attention in plain PyTorch: the definition of correct that every other backend is
tested against, and the backend that runs on a CPU.

Layouts shared by every backend in this package:

* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one pair per
  layer. Token ``t`` of a request lives in slot ``t % block_size`` of block
  ``block_table[t // block_size]``, i.e. at flat slot
  ``block_table[t // block_size] * block_size + t % block_size``.
* block tables: int32 ``[batch, max_blocks_per_seq]``, one row per request. Entries past a
  request's last block are padding, filled with 0 by convention. No kernel reads them (each
  stops at its own context length), but 0 keeps every entry a valid block id, which lets this
  reference gather whole rows in one indexing op instead of masking the table.
* context lens: int32 ``[batch]``, the tokens in the cache for each request *including* the new
  query tokens, whose K/V are stored (``store_kv``) before attention runs. So a request's
  ``q_len`` queries are its last ``q_len`` cached tokens, and ``context_len >= q_len >= 1``.
* GQA: ``num_heads = group * num_kv_heads``; query head ``h`` reads kv head ``h // group``.

The reference materialises each request's K/V densely (one gather of whole blocks), so it is
simple rather than fast; the softmax runs in fp32 whatever the cache dtype, and the output has
``q``'s dtype. Decode splits into a plan and a run (as FlashInfer's decode wrappers do):
:class:`DecodePlan` does the index work that depends only on the block tables and context lens
once, and running it per layer is then just the gather and the attention. An engine calling
the same step for every layer of a model plans once per step; on a CPU, where each small op
costs microseconds of dispatch, that matters as much as the bytes moved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Devices where BlockGather masks stale positions instead of listing them: listing needs their
# count on the host (nonzero), a wait for the device that a CUDA graph or chapter 07's overlapped
# loop must not have.
MASK_STALE_ON = {"cuda"}

# A step whose requests all bring fewer new tokens than this attends them one at a time, each as
# its decode would be (the C++ kernel's kMinTileTokens, the same rule): a verification step's
# k + 1 tokens then give bit for bit the logits their decodes would have at batch 1 (chapter
# 14), which matters where activations are rounded to int8 after attention (chapter 13), as a
# last-bit difference there moves a code.
DECODE_RUN_TOKENS = 16


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V (``[num_tokens, num_kv_heads, head_dim]``) into their slots.

    ``slot_mapping`` is int64 ``[num_tokens]`` of flat slot ids (``block * block_size +
    offset``); every entry must be a real slot (there is no "skip" value). One ``index_copy_``
    per tensor, on a ``[num_blocks * block_size, num_kv_heads, head_dim]`` view of the cache:
    the cache of a layer is contiguous, so the view aliases it and the write lands in place.
    """
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One new token per request: ``q`` ``[batch, num_heads, head_dim]`` -> same shape.

    The query is the last cached token, so it sees all ``context_lens[i]`` tokens."""
    return DecodePlan(block_tables, context_lens, k_cache.shape[1])(q, k_cache, v_cache, scale)


class DecodePlan:
    """:func:`paged_decode_attention` for one set of block tables and context lens, with the
    work that does not depend on the layer done once, here: calling the plan with a layer's
    ``q``, ``k_cache``, ``v_cache`` and ``scale`` gives that function's result.

    ``max_context_len``: a bound on the context lens that the caller knows on the host (see
    :class:`BlockGather`); with it, on CUDA, planning and running read nothing back from the
    device, which a CUDA graph capture and chapter 07's overlapped loop need."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 block_size: int, max_context_len: int | None = None) -> None:
        self.gather = BlockGather(block_tables, context_lens, block_size, max_context_len)
        # The query is the last cached token: it sees exactly its context. Additive, so the
        # attention does not convert a boolean mask again in every layer.
        in_context = self.gather.in_context[:, None, None, :]  # [batch, 1, 1, context]
        self.mask = torch.zeros(in_context.shape, device=in_context.device).masked_fill_(
            ~in_context, float("-inf"))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        keys, values = self.gather(k_cache), self.gather(v_cache)
        batch, heads, head_dim = q.shape
        kv_heads = keys.shape[1]
        # With one query per head, the heads that share a kv head (head h reads h // group) can
        # be that kv head's queries: [batch, kv_heads, group, dim]. SDPA then reads each kv head
        # once, where enable_gqa would expand K/V to every head (about 1.3-2x slower per layer
        # on our CPU). The mask is the same for every query of a request.
        grouped = q.float().view(batch, kv_heads, heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=self.mask,
                                             scale=scale)
        return out.reshape(batch, heads, head_dim).to(q.dtype)


class BlockGather:
    """Reads each request's blocks into a dense fp32 ``[batch, kv_heads, context, head_dim]``
    copy, ``context`` spanning the blocks of the longest request in the batch.

    Whole blocks are gathered, not single slots: one index per block, each a contiguous
    ``block_size`` tokens, copies about twice as fast on a CPU. Positions past a request's
    context are zeroed afterwards: whatever they hold (the rest of a last block, the padding
    of a table), NaN included, must not reach the output, and masking the score alone would not
    do (NaN + -inf = NaN, 0 * NaN = NaN).
    """

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 block_size: int, max_context_len: int | None = None) -> None:
        # Tables are sized for the longest request the engine allows; read only the blocks
        # the longest request in this batch uses. Without a bound from the caller that length
        # is read back from the device (a sync); a bound past the table means the whole table.
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        max_blocks = min(-(-max_context_len // block_size), block_tables.shape[1])
        self.blocks = block_tables[:, :max_blocks].flatten().long()
        positions = torch.arange(max_blocks * block_size, device=context_lens.device)
        self.in_context = positions < context_lens[:, None]  # [batch, context]
        stale = ~self.in_context.view(-1, 1, 1)
        if context_lens.device.type in MASK_STALE_ON:
            self.stale_mask, self.stale_rows = stale, None
        else:
            # On a CPU nothing runs ahead of the host, so the count nonzero() reads costs no
            # wait, and filling only the stale rows is several times faster than a masked fill.
            self.stale_mask, self.stale_rows = None, stale.flatten().nonzero().squeeze(1)

    def __call__(self, cache: torch.Tensor) -> torch.Tensor:
        batch, context = self.in_context.shape
        num_kv_heads, head_dim = cache.shape[2:]
        dense = torch.index_select(cache, 0, self.blocks).view(-1, num_kv_heads, head_dim)
        if self.stale_rows is None:
            dense.masked_fill_(self.stale_mask, 0.0)
        else:
            dense.index_fill_(0, self.stale_rows, 0.0)
        return dense.view(batch, context, num_kv_heads, head_dim).transpose(1, 2).float()


def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float,
                           max_seqlen_q: int | None = None) -> torch.Tensor:
    """Several new tokens per request (prefill, chunked prefill, decodes mixed in):
    ``q`` ``[total_q, num_heads, head_dim]`` -> same shape.

    Request ``i`` owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` (int32 ``[batch + 1]``), its
    last ``q_len_i`` tokens; query ``j`` sees positions ``<= context_lens[i] - q_len_i + j``
    (causal, aligned to the end of the context). ``max_seqlen_q`` saves reading it back from
    the device when the caller already knows it.
    """
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    if max_seqlen_q is None:
        max_seqlen_q = int(q_lens.max())
    rows = torch.arange(q.shape[0], device=q.device)
    seq_of_row = torch.searchsorted(cu_seqlens_q[1:], rows, right=True)
    index_in_seq = rows - cu_seqlens_q[seq_of_row]
    if max_seqlen_q < DECODE_RUN_TOKENS:
        # Every run is short (decodes, or drafts to verify): each row is a decode of its own
        # context. Mixed with a longer prefill, the rows go in the batch as they always did.
        return _as_decodes(q, k_cache, v_cache, block_tables, context_lens, q_lens, seq_of_row,
                           index_in_seq, scale)
    # Pad the queries to [batch, max_seqlen_q, ...] so one batched matmul serves every request;
    # (request, index in request) of each row addresses the padded tensor in both directions.
    q_padded = q.new_zeros(len(q_lens), max_seqlen_q, *q.shape[1:])
    q_padded[seq_of_row, index_in_seq] = q
    gather = BlockGather(block_tables, context_lens, k_cache.shape[1])
    # Absolute position of each query: the last q_len cached tokens of its request.
    q_positions = (context_lens - q_lens)[:, None] + torch.arange(max_seqlen_q, device=q.device)
    positions = torch.arange(gather.in_context.shape[1], device=q.device)
    visible = positions[None, None, :] <= q_positions[:, :, None]  # [batch, max_q, context]
    # Padding query rows (index >= q_len) sit past the context; this bound keeps them inside
    # it. They still see position 0, so no row is all -inf (no NaN).
    visible &= gather.in_context[:, None, :]
    out = _attend(q_padded, gather(k_cache), gather(v_cache), visible, scale)
    return out[seq_of_row, index_in_seq]


def _as_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, q_lens: torch.Tensor,
                seq_of_row: torch.Tensor, index_in_seq: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Each row of ``q`` (token ``index_in_seq[r]`` of request ``seq_of_row[r]``) attended alone,
    as a decode of its context up to itself. Alone, because SDPA's CPU kernel splits its work
    over threads by the batch's shape, so a row's sum depends on the rows beside it."""
    row_context = (context_lens - q_lens)[seq_of_row] + index_in_seq + 1
    block_size = k_cache.shape[1]
    return torch.cat([
        DecodePlan(block_tables[seq:seq + 1], context, block_size)(q[row:row + 1], k_cache,
                                                                    v_cache, scale)
        for row, (seq, context) in enumerate(zip(seq_of_row.tolist(),
                                                 row_context.split(1), strict=True))])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """``q`` ``[batch, max_q, num_heads, head_dim]``, each request's queries left-aligned, and
    ``mask`` ``[batch, max_q, context]``: which positions each query attends to (bool), or what
    to add to its scores (fp32, 0 or -inf). Rows past a request's queries are padding whose
    output is garbage but finite."""
    # Query heads of one GQA group share a kv head (enable_gqa): head h reads h // group.
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), keys, values,
                                         attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=q.shape[2] != keys.shape[1])
    return out.transpose(1, 2).to(q.dtype)
