"""The two ways the compiled forward attends where the C++ kernel does not (chapter 11; on a
CPU where it builds, the kernel attends every token: :mod:`miniinfer.core.kernels.cpu_decode`).

**Fused, in the graph** (:func:`fused_paged_attention`): every token reads its own request's
K/V from the pool through its block table, written as products and sums that inductor fuses
with the indexed loads. No copy, no kernel launch per request: the fastest way for decode steps
and small mixed steps, where each token reads a context once anyway.

**By segment, as an op the graph calls** (:func:`segment_attention`): a prompt chunk's tokens
all read the same context, and the fused formula reads it once *per token* with elementwise
arithmetic: at a 512-token chunk that took longer than every matmul of the step together.
There, attention is a matrix product (each K row meets every query of the chunk), which SDPA
does with GEMM micro-kernels. The op cuts a step's tokens into segments (runs of one request's
consecutive positions), attends each prompt chunk with SDPA over its own request's K/V only,
and all single-token segments (decodes) in one batched decode (the reference kernels' one). To
inductor it is an opaque call (a ``torch.library`` custom op with a fake for tracing), so
the rest of the layer stays compiled around it. It reads the segments back to the host, which
a CPU step can afford and a CUDA graph could not, so it runs on CPUs only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..core.kernels.reference import DecodePlan


def fused_paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          visible: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[T, heads, dim]``; ``keys``/``values`` ``[T, context, kv_heads, dim]``, each
    token's context as read from the pool (inside the compiled graph an indexed load, never a
    materialised copy); ``visible`` ``[T, context]``. Softmax in fp32, as the reference.

    Written as products and sums, not matmuls, so that inductor fuses the indexed loads into
    the two reductions; and laid out ``[T, context, kv_heads, group, ...]`` so that both
    reductions read K and V along ``dim``, where a slot's values lie next to each other. (With
    the context last, the weights-times-V sum ran along the context: one scalar load per slot
    and value, 2-10x slower at batch 8 on our CPU; measured against SDPA and matmuls over a
    gathered copy too, this was the fastest at batch 1 and 8, context 80-208.)"""
    tokens, heads, dim = q.shape
    kv_heads = keys.shape[2]
    # The heads of a GQA group share one kv head.
    grouped = q.float().view(tokens, 1, kv_heads, heads // kv_heads, dim)
    scores = (grouped * keys.float()[:, :, :, None, :]).sum(-1) * scale  # [T, C, kvh, group]
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=1)
    out = (weights[..., None] * values.float()[:, :, :, None, :]).sum(1)  # [T, kvh, group, dim]
    return out.reshape(tokens, heads, dim).to(q.dtype)


@torch.library.custom_op("miniinfer::segment_attention", mutates_args=())
def segment_attention(q: torch.Tensor, pool: torch.Tensor, k_base: int, v_base: int,
                      block_size: int, real: torch.Tensor, position_ids: torch.Tensor,
                      token_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a bucket's tokens (``q`` ``[T, heads, dim]``) over the flat ``pool``
    (``[slots, kv_heads, dim]``; this layer's K from row ``k_base``, its V from ``v_base``),
    after their K/V were written. ``position_ids``, ``token_tables``: each token's position and
    block table; ``real`` ``[T]``: which tokens are not padding (padding only ever follows
    the real tokens, and its output is zeros)."""
    plan = _segment_plan(real, position_ids, token_tables, block_size)
    k_layer, v_layer = pool[k_base:v_base], pool[v_base : 2 * v_base - k_base]
    out = torch.zeros_like(q)
    if plan.singles is not None:  # decodes (and one-token chunks): one batched decode
        index, decode = plan.singles
        out[index] = decode(q[index], k_layer.view(-1, block_size, *pool.shape[1:]),
                            v_layer.view(-1, block_size, *pool.shape[1:]), scale)
    for start, end, slots, mask, count in plan.chunks:  # prompt chunks, each over its request
        out[start:end] = _chunk_attention(q[start:end], k_layer.index_select(0, slots),
                                          v_layer.index_select(0, slots), mask, count, scale)
    return out


class _Chunks(NamedTuple):
    """Rows ``start:end`` of ``count`` prompt chunks of one length, back to back, and their
    contexts' slots within a layer's rows of the pool; ``mask`` ``[L, context]`` which
    positions each query sees (None: chunks from position 0, SDPA's own causal case; a masked
    entry holds one chunk)."""

    start: int
    end: int
    slots: torch.Tensor
    mask: torch.Tensor | None
    count: int


@dataclass(frozen=True, slots=True)
class _SegmentPlan:
    """How one step's tokens attend by segment, the same in every layer: the single-token
    segments' rows and their decode plan (None: there are none), and the longer segments:
    consecutive chunks of one length that start their prompts attend as one batch."""

    singles: tuple[torch.Tensor, DecodePlan] | None
    chunks: list[_Chunks]


# The last plan made, by the values it was made from (see _segment_plan).
_last_plan: tuple[tuple, _SegmentPlan] | None = None


def _segment_plan(real: torch.Tensor, position_ids: torch.Tensor, token_tables: torch.Tensor,
                  block_size: int) -> _SegmentPlan:
    """The step's plan. Every layer of a step passes the same positions and tables, and making
    the plan is a few dozen small ops (about half a millisecond per prompt chunk, more than
    SDPA's own time on a 64-token chunk), so it is made once per step: kept with the exact
    values it was made from, and remade whenever a call's values differ."""
    global _last_plan
    key = (block_size, real.numpy().tobytes(), position_ids.dtype,
           position_ids.numpy().tobytes(), token_tables.dtype, token_tables.shape,
           token_tables.numpy().tobytes())
    last = _last_plan
    if last is not None and last[0] == key:
        return last[1]
    num_real = int(real.sum())
    positions, tables = position_ids[:num_real], token_tables[:num_real]
    # A segment starts wherever the request (its table) changes or the positions do not run on.
    starts = torch.ones(num_real, dtype=torch.bool)
    starts[1:] = (positions[1:] != positions[:-1] + 1) | (tables[1:] != tables[:-1]).any(1)
    bounds = [*starts.nonzero().flatten().tolist(), num_real]
    segments = list(zip(bounds[:-1], bounds[1:], strict=True))
    singles = [start for start, end in segments if end - start == 1]
    decode = None
    if singles:
        index = torch.tensor(singles)
        decode = (index, DecodePlan(tables[index], (positions[index] + 1).int(), block_size))
    chunks = []
    for start, end in segments:
        if end - start > 1:  # its own request's slots, up to its last token
            first, context = int(positions[start]), int(positions[end - 1]) + 1
            seen = torch.arange(context)
            slots = tables[start, seen // block_size].long() * block_size + seen % block_size
            last = chunks[-1] if chunks else None
            if first:  # a later chunk sees every earlier position as well: a mask
                mask = seen <= torch.arange(first, first + end - start)[:, None]
                chunks.append(_Chunks(start, end, slots, mask, 1))
            elif last is not None and last.mask is None and last.end == start \
                    and last.end - last.start == last.count * (end - start):
                # The same length as the causal chunks just before it: one more in their batch
                # (a batch of eight prompts' first chunks is one SDPA call per layer, not eight).
                chunks[-1] = _Chunks(last.start, end, torch.cat([last.slots, slots]), None,
                                     last.count + 1)
            else:
                chunks.append(_Chunks(start, end, slots, None, 1))
    plan = _SegmentPlan(decode, chunks)
    _last_plan = (key, plan)
    return plan


@segment_attention.register_fake
def _(q, pool, k_base, v_base, block_size, real, position_ids, token_tables, scale):
    return torch.empty_like(q)


def _chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor | None, count: int, scale: float) -> torch.Tensor:
    """``count`` prompt chunks of one length ``L``, back to back: ``q`` ``[count * L, heads,
    dim]`` over their requests' ``keys``/``values`` ``[count * context, kv_heads, dim]``.
    ``mask`` ``[L, context]`` (one chunk only): which positions each query sees; None for
    chunks from position 0 (``context == L``), SDPA's own causal case, which skips the masked
    half of the scores."""
    heads = q.shape[1]
    # As [count, heads, L, dim]: without the batch dimension SDPA on a CPU takes its unfused
    # (matmul, softmax, matmul) path instead of the flash kernel.
    out = F.scaled_dot_product_attention(
        *(t.float().unflatten(0, (count, -1)).transpose(1, 2) for t in (q, keys, values)),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=heads != keys.shape[1])
    return out.transpose(1, 2).flatten(0, 1).to(q.dtype)
