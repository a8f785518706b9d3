"""Stage ``paged-attention``: the model's attention reads K/V straight from the blocks.

Chapters 02-04 kept HF's attention and fed it what it wants: every request's history as dense,
left-padded K/V per layer, rebuilt from the blocks each step, plus a dense ``[B, L]`` mask.
However cheap the gather became, it is a step of its own that copies every request's whole
history, and HF's attention then reads the copy. Here the attention itself changes: a paged
kernel (:mod:`miniinfer.core.kernels`) takes the pool, the block tables and the context lens and
finds each request's K/V itself. On a GPU (Triton, flash-attn) it reads them where they lie;
the CPU reference still copies blocks, inside the kernel, because PyTorch has no paged SDPA.

How it runs (the pieces live in :mod:`miniinfer.runner`, which chapter 08 reuses):

- the forward is the runner's: our own Llama/Qwen2 forward (``direct``), or HF's modules with
  :func:`~miniinfer.runner.attention.paged_attention_forward` registered in transformers'
  ``AttentionInterface`` as ``"miniinfer_paged"`` (``registry``). The model is switched to it
  for the length of a generate call, as transformers' own continuous batching does with its
  ``"paged|..."`` implementations, then switched back, so other engines sharing the model are
  unaffected. No dense mask is built: ``create_causal_mask`` returns None at once for an
  implementation ``AttentionMaskInterface`` does not know.
- all requests' new tokens go in as one flat sequence ``[1, total_tokens]``, each request with
  its own positions, so there is no padding anywhere. Block tables, context lens and slot
  mapping travel in one :class:`~miniinfer.runner.StepBatch`, from which the forward makes the
  metadata every layer's attention receives.
- the attention function stores the new tokens' K/V in their slots, then runs the varlen
  kernel (prefill: whole prompts, causal) or the decode kernel (one token per request). What a
  decode kernel works out from the block tables alone is the same in every layer; a backend that
  can (the CPU reference) plans it in the first layer and the other layers reuse the plan.
- the block tables stay on the device for the whole call; a step only adds the entry of a
  block a request has just started. What does change per step (context lens, positions, slot
  mapping, new block table entries) is packed into one host buffer, pinned on CUDA, and sent
  with a single non-blocking copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from ..core.kv_cache import DEFAULT_BLOCK_SIZE, KVCacheConfig, blocks_for
from ..core.models import LoadedModel
from ..core.ranges import phase
from ..core.sampling import SamplingParams, sample
from ..runner import ModelRunner, StepBatch, decode_batch
from .base import Engine, GenerationResult
from .paged_loop import PagedLoopEngine


@dataclass(slots=True)
class PagedBatch:
    """The requests decoding in lockstep; row ``i`` of the block tables is ``request_ids[i]``."""

    request_ids: list[int]
    block_tables: torch.Tensor  # int32 [B, blocks of the longest request], on the device


class PagedAttentionEngine(PagedLoopEngine):
    name = "paged-attention"
    summary = "attention kernel reads KV through block tables: no gather step, no dense mask"
    # "paged-attention:registry" runs HF's modules with our attention plugged in by name;
    # "paged-attention:direct" our own forward over the same weights (see the runner).
    variant_option = "forward"
    variants = ("direct", "registry", "auto")

    def __init__(self, lm: LoadedModel, attention_backend: str | None = None,
                 forward: str = "auto", block_size: int = DEFAULT_BLOCK_SIZE,
                 num_blocks: int | None = None, kv_cache_bytes: int | None = None) -> None:
        # Not PagedLoopEngine's __init__: the pool is the runner's, which also owns the
        # attention backends and the forward (HF's modules or ours, see miniinfer.runner).
        Engine.__init__(self, lm)
        self.runner = ModelRunner(lm, KVCacheConfig(block_size, num_blocks, kv_cache_bytes),
                                  forward=forward, attention_backend=attention_backend)
        self.kv_cache = self.runner.kv_cache

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        with self.runner.paged_attention():
            return super()._generate(prompts, params)

    def prefill(self, request_ids: list[int], prompts: list[list[int]],
                params: SamplingParams) -> tuple[PagedBatch, torch.Tensor]:
        """Take blocks for every prompt (before any compute, so a full pool fails fast) and run
        all prompts as one flat sequence; attention writes their K/V into the blocks."""
        block_manager = self.kv_cache.block_manager
        device = self.device
        self.take_blocks(request_ids, prompts, params)
        lens = [len(p) for p in prompts]
        # Wide enough for the longest request's last fed token (the last sampled token is never
        # fed), so a decode step only ever fills in entries.
        width = blocks_for(max(lens) + params.max_new_tokens - 1, self.kv_cache.block_size)
        tables = [block_manager.block_tables[rid] for rid in request_ids]
        block_tables = torch.tensor([table + [0] * (width - len(table)) for table in tables],
                                    dtype=torch.int32, device=device)
        cu_seqlens_q = torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=device)
        # Each prompt token's request (row) and position, then its slot, as tensor ops: a
        # Python call per token cost ~35 ms of a ~750 ms batch-8 prefill on our CPU.
        total = int(sum(lens))
        lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
        row = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t,
                                      output_size=total)
        positions = torch.arange(total, device=device) - cu_seqlens_q[:-1].long()[row]
        block_size = self.kv_cache.block_size
        slot_mapping = (block_tables[row, positions // block_size].long() * block_size
                        + positions % block_size)
        # Only each prompt's last position predicts a token.
        step = StepBatch(torch.tensor([t for p in prompts for t in p], device=device), positions,
                         slot_mapping, block_tables, lens_t, row, num_decodes=0,
                         query_starts=cu_seqlens_q, max_query_len=max(lens),
                         logits_rows=cu_seqlens_q[1:] - 1)
        logits = self.model_forward(step)
        return PagedBatch(request_ids, block_tables), logits

    def take_blocks(self, request_ids: list[int], prompts: list[list[int]],
                    params: SamplingParams) -> None:
        """Blocks for each prompt; decode steps take more as their tokens arrive."""
        for rid, prompt in zip(request_ids, prompts, strict=True):
            self.kv_cache.block_manager.add(rid, len(prompt))

    def decode_step(self, batch: PagedBatch, tokens: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator | None) -> torch.Tensor:
        """Feed each row's last token; returns the next ones. The K/V writes happen inside the
        forward, in every layer's attention."""
        with phase("prepare_inputs"):
            step = self.prepare_inputs(batch, tokens)
        with phase("model_forward"):
            logits = self.model_forward(step)
        with phase("sample"):
            return sample(logits, params, generator)

    def prepare_inputs(self, batch: PagedBatch, tokens: torch.Tensor) -> StepBatch:
        """Take a slot for each row's token and send this step's metadata in one copy."""
        block_manager = self.kv_cache.block_manager
        context_lens, positions, slots, new_entries = [], [], [], []
        for row, rid in enumerate(batch.request_ids):
            # A new block only when the last one is full: then one block table entry changes.
            for block in block_manager.append(rid):
                new_entries += (row, len(block_manager.block_tables[rid]) - 1, block)
            n = block_manager.num_tokens[rid]
            context_lens.append(n)
            positions.append(n - 1)
            slots.append(block_manager.slot(rid, n - 1))
        staged = self.runner.stage(context_lens + positions + slots + new_entries)
        context_lens, positions, slots, entries = staged.split(
            [len(slots)] * 3 + [len(new_entries)])
        if new_entries:
            rows, cols, blocks = entries.view(-1, 3).unbind(1)
            batch.block_tables[rows, cols] = blocks
        return decode_batch(tokens, positions, slots.long(), batch.block_tables, context_lens)

    def model_forward(self, step: StepBatch) -> torch.Tensor:
        """Logits ``[rows, V]`` of the positions ``step.logits_rows`` picks (None: every
        position, which in decode is one per request). No cache object: the K/V live in the
        pool."""
        return self.runner.forward(step)
