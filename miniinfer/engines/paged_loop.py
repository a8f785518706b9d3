"""Stage ``paged-loop``: the KV cache moves into fixed-size blocks of a preallocated pool.

Prefill runs like ``naive`` (one left-padded batch forward), then each request's prompt K/V is
copied into the blocks of its block table. The model itself still wants the dense cache HF
builds, so every decode step rebuilds one from the blocks: gather every request's history into
the left-padded ``[B, kv_heads, L, head_dim]`` layout HF's own batch has, wrap it in a
``DynamicCache``, run one token per request, then write the new token's K/V back into the blocks.

The gather is written the obvious way, with Python loops over layers x requests x blocks: the
honest "before" that chapter 02 measures and chapters 03-04 take apart. Each part of the step is
a method in its own profiler range, so later stages override one part at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache

from ..core.kv_cache import DEFAULT_BLOCK_SIZE, KVCacheConfig, PagedKVCache
from ..core.models import LoadedModel
from ..core.ranges import phase
from ..core.sampling import SamplingParams, make_generator, sample
from .base import Engine, GenerationResult, StepClock, left_pad, trim_at_eos

# One dense K/V pair per layer, each [B, kv_heads, L, head_dim].
DenseKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class DecodeBatch:
    """The requests decoding in lockstep and where each sits in the dense left-padded layout.

    Row ``i`` is request ``request_ids[i]``; its tokens fill the last of the ``history_len``
    dense columns, after left padding that stays as wide as it was after prefill (a finished
    row keeps decoding padding, as in ``naive``).
    """

    request_ids: list[int]
    attention_mask: torch.Tensor  # [B, widest prompt + max_new_tokens], sliced per step
    positions: torch.Tensor  # [B] position of the token each row feeds next
    history_len: int  # L: dense columns of K/V before this step's token


class PagedLoopEngine(Engine):
    name = "paged-loop"
    summary = "paged KV cache in fixed-size blocks, Python-loop gather each step"

    def __init__(self, lm: LoadedModel, block_size: int = DEFAULT_BLOCK_SIZE,
                 num_blocks: int | None = None, kv_cache_bytes: int | None = None) -> None:
        super().__init__(lm)
        # Allocated once with the engine, like a serving engine's KV pool: requests only borrow
        # blocks from it.
        self.kv_cache = PagedKVCache(lm, KVCacheConfig(block_size, num_blocks, kv_cache_bytes))

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        block_manager = self.kv_cache.block_manager
        request_ids = list(range(len(prompts)))
        try:
            return self._run(request_ids, prompts, params)
        finally:
            # Finished, failed (KVCacheFull) or interrupted: the blocks always go back.
            for rid in request_ids:
                if rid in block_manager:
                    block_manager.free(rid)

    def _run(self, request_ids: list[int], prompts: list[list[int]],
             params: SamplingParams) -> GenerationResult:
        lm = self.lm
        generator = make_generator(params, self.device)
        clock = StepClock(self.device)
        with phase("prefill"):
            batch, logits = self.prefill(request_ids, prompts, params)
            tokens = sample(logits, params, generator)
        finished = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        generated: list[torch.Tensor] = []
        for step in range(params.max_new_tokens):
            if step > 0:
                with phase("decode_step"):
                    tokens = self.decode_step(batch, tokens, params, generator)
            tokens, stop = self.pad_finished(tokens, finished, params)
            generated.append(tokens)
            clock.tick()
            if stop:
                break
        rows = torch.stack(generated, dim=1).tolist()
        return clock.finish(trim_at_eos(rows, None if params.ignore_eos else lm.eos_token_id))

    def prefill(self, request_ids: list[int], prompts: list[list[int]],
                params: SamplingParams) -> tuple[DecodeBatch, torch.Tensor]:
        """Take blocks for every prompt (before any compute, so a full pool fails fast), run
        the prompts as one left-padded batch and copy their K/V into the blocks."""
        for rid, prompt in zip(request_ids, prompts, strict=True):
            self.kv_cache.block_manager.add(rid, len(prompt))
        input_ids, prompt_mask = left_pad(prompts, self.lm.pad_token_id, self.device)
        # Room for every step's column up front; a step slices what it needs.
        attention_mask = torch.cat(
            [prompt_mask, prompt_mask.new_ones(len(prompts), params.max_new_tokens)], dim=1)
        # Positions count real tokens only; pad slots are masked (1 matches generate()).
        position_ids = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 1)
        cache = DynamicCache(config=self.model.config)
        logits = self.model_forward(
            {"input_ids": input_ids, "attention_mask": prompt_mask, "position_ids": position_ids},
            cache)
        # A row's next position is its prompt length; its history, the padded prompt width.
        batch = DecodeBatch(request_ids, attention_mask, prompt_mask.sum(-1), input_ids.shape[1])
        self.write_prefill_kv(batch, cache)
        return batch, logits

    def decode_step(self, batch: DecodeBatch, tokens: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator | None) -> torch.Tensor:
        """Feed each row's last token; returns the next ones."""
        with phase("prepare_inputs"):
            inputs = self.prepare_inputs(batch, tokens)
        with phase("gather_batch_kv"):
            dense = self.gather_batch_kv(batch)
        with phase("build_cache"):
            cache = self.build_cache(dense)
        with phase("model_forward"):
            logits = self.model_forward(inputs, cache)
        with phase("sample"):
            next_tokens = sample(logits, params, generator)
        with phase("write_decode_kv"):
            self.write_decode_kv(batch, cache)
        batch.history_len += 1
        batch.positions += 1
        return next_tokens

    def prepare_inputs(self, batch: DecodeBatch, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "input_ids": tokens[:, None],
            "position_ids": batch.positions[:, None],
            # History columns plus this step's token.
            "attention_mask": batch.attention_mask[:, : batch.history_len + 1],
        }

    def block_segments(self, batch: DecodeBatch) -> Iterator[tuple[int, int, int, int]]:
        """``(row, first dense column, block, tokens)`` for every block of every request: where
        each block's tokens sit in the dense left-padded layout."""
        block_manager = self.kv_cache.block_manager
        block_size = self.kv_cache.block_size
        for row, rid in enumerate(batch.request_ids):
            num_tokens = block_manager.num_tokens[rid]
            start = batch.history_len - num_tokens
            for j, block in enumerate(block_manager.block_tables[rid]):
                first = j * block_size
                yield row, start + first, block, min(block_size, num_tokens - first)

    def write_prefill_kv(self, batch: DecodeBatch, cache: Cache) -> None:
        """Copy each request's prompt K/V, padding left out, into its blocks."""
        kv = self.kv_cache.kv
        for layer, cache_layer in enumerate(cache.layers):
            dense = torch.stack((cache_layer.keys, cache_layer.values))  # [2, B, H, W, D]
            for row, col, block, n in self.block_segments(batch):
                kv[layer, :, block, :n] = dense[:, row, :, col : col + n].transpose(1, 2)

    def gather_batch_kv(self, batch: DecodeBatch) -> DenseKV:
        """Every request's history as dense left-padded K and V per layer, block by block."""
        kv = self.kv_cache.kv
        _, _, _, _, kv_heads, head_dim = kv.shape
        out = []
        for layer in range(self.kv_cache.num_layers):
            dense = torch.zeros((2, len(batch.request_ids), kv_heads, batch.history_len, head_dim),
                                dtype=kv.dtype, device=kv.device)
            for row, col, block, n in self.block_segments(batch):
                dense[:, row, :, col : col + n] = kv[layer, :, block, :n].transpose(1, 2)
            out.append((dense[0], dense[1]))
        return out

    def build_cache(self, dense: DenseKV) -> Cache:
        """Hand the dense K/V to the model as the cache it already knows."""
        cache = DynamicCache(config=self.model.config)
        for layer, (keys, values) in enumerate(dense):
            cache.update(keys, values, layer)
        return cache

    def model_forward(self, inputs: dict[str, torch.Tensor], cache: Cache) -> torch.Tensor:
        """Last-position logits [B, V]; the forward appends the new K/V to ``cache``."""
        return self.model(**inputs, past_key_values=cache, use_cache=True,
                          logits_to_keep=1).logits[:, -1, :]

    def write_decode_kv(self, batch: DecodeBatch, cache: Cache) -> None:
        """Take room for the token this step fed and copy its K/V (the cache's last column)
        into each request's blocks."""
        block_manager = self.kv_cache.block_manager
        for rid in batch.request_ids:
            block_manager.append(rid)
        slots = self.kv_cache.slots
        for layer, cache_layer in enumerate(cache.layers):
            for row, rid in enumerate(batch.request_ids):
                slot = block_manager.slot(rid, block_manager.num_tokens[rid] - 1)
                slots[layer, 0, slot] = cache_layer.keys[row, :, -1]
                slots[layer, 1, slot] = cache_layer.values[row, :, -1]
