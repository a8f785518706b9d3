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

The reference materialises each request's K/V densely (one gather), so it is simple rather than
fast; the softmax runs in fp32 whatever the cache dtype, and the output has ``q``'s dtype.
"""

from __future__ import annotations

import torch


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
    q_lens = torch.ones_like(context_lens)
    return _attend(q.unsqueeze(1), q_lens, k_cache, v_cache, block_tables, context_lens,
                   scale).squeeze(1)


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
    # Pad the queries to [batch, max_seqlen_q, ...] so one batched matmul serves every request;
    # (request, index in request) of each row addresses the padded tensor in both directions.
    rows = torch.arange(q.shape[0], device=q.device)
    seq_of_row = torch.searchsorted(cu_seqlens_q[1:], rows, right=True)
    index_in_seq = rows - cu_seqlens_q[seq_of_row]
    q_padded = q.new_zeros(len(q_lens), max_seqlen_q, *q.shape[1:])
    q_padded[seq_of_row, index_in_seq] = q
    out = _attend(q_padded, q_lens, k_cache, v_cache, block_tables, context_lens, scale)
    return out[seq_of_row, index_in_seq]


def _attend(q: torch.Tensor, q_lens: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor,
            scale: float) -> torch.Tensor:
    """``q`` ``[batch, max_q, num_heads, head_dim]``, each request's queries left-aligned (rows
    past ``q_lens[i]`` are padding whose output is garbage but finite)."""
    batch, max_q, num_heads, head_dim = q.shape
    out_dtype = q.dtype
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    # Tables are sized for the longest request the engine allows; gather only the blocks the
    # longest request in this batch uses.
    max_blocks = -(-int(context_lens.max()) // block_size)
    blocks = block_tables[:, :max_blocks].long()
    # [batch, max_blocks, block_size, kv_heads, dim] -> [batch, kv_heads, context, dim]
    keys = k_cache[blocks].flatten(1, 2).transpose(1, 2).float()
    values = v_cache[blocks].flatten(1, 2).transpose(1, 2).float()

    positions = torch.arange(max_blocks * block_size, device=q.device)
    # Absolute position of each query: the last q_len cached tokens of its request.
    q_positions = (context_lens - q_lens)[:, None] + torch.arange(max_q, device=q.device)
    visible = positions[None, None, :] <= q_positions[:, :, None]  # [batch, max_q, context]
    # Padding query rows (index >= q_len) sit past the context; without this bound they would
    # see unwritten slots. They still see position 0, so no row is all -inf (no NaN).
    visible &= positions[None, None, :] < context_lens[:, None, None]
    # Slots past the context may hold anything, NaN included (the cache starts as torch.empty),
    # and 0 * NaN = NaN, so zero them rather than rely on the softmax weight being 0.
    in_context = (positions[None, :] < context_lens[:, None])[:, None, :, None]
    values = values.masked_fill(~in_context, 0.0)

    # Query heads of one GQA group share a kv head: [batch, kv_heads, group * max_q, dim].
    q = q.float().view(batch, max_q, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * max_q, head_dim)
    scores = (q @ keys.transpose(-1, -2)) * scale
    mask = visible[:, None, None].expand(batch, num_kv_heads, group, max_q, -1)
    scores = scores.masked_fill(~mask.reshape(scores.shape), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values
    out = out.view(batch, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, max_q, num_heads, head_dim).to(out_dtype)
