"""Stage ``paged-attention``: the model's attention reads K/V straight from the blocks.

Chapters 02-04 kept HF's attention and fed it what it wants: every request's history as dense,
left-padded K/V per layer, rebuilt from the blocks each step, plus a dense ``[B, L]`` mask.
However cheap the gather became, it is a step of its own that copies every request's whole
history, and HF's attention then reads the copy. Here the attention itself changes: a paged
kernel (:mod:`miniinfer.kernels`) takes the pool, the block tables and the context lens and
finds each request's K/V itself. On a GPU (Triton, flash-attn) it reads them where they lie;
the CPU reference still copies blocks, inside the kernel, because PyTorch has no paged SDPA.

How it plugs into transformers:

- transformers looks attention up by name in its ``AttentionInterface``. We register
  :func:`paged_attention_forward` as ``"miniinfer_paged"`` and switch the model to it for the
  length of a generate call, as transformers' own continuous batching does with its
  ``"paged|..."`` implementations, then switch back, so other engines sharing the model are
  unaffected. The name is left out of ``AttentionMaskInterface`` on purpose: for an
  implementation unknown to it, ``create_causal_mask`` returns None at once, so no mask is built
  (registering one that returns None would still run its packed-sequence scan first).
- all requests' new tokens go in as one flat sequence ``[1, total_tokens]``, each request with
  its own positions, so there is no padding anywhere. Block tables, context lens and slot
  mapping travel in one :class:`PagedAttentionMetadata` keyword argument, which transformers
  hands down to every layer's attention function untouched.
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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import torch
from transformers import AttentionInterface, PreTrainedModel

from ..errors import MiniInferError, UnknownNameError
from ..kernels import (
    BACKENDS,
    AttentionBackend,
    DecodeFn,
    available_backends,
    get_backend,
    triton_attention,
)
from ..kv_cache import blocks_for
from ..models import LoadedModel
from ..ranges import phase
from ..sampling import SamplingParams, sample
from .base import GenerationResult
from .direct_forward import DirectForward, unsupported_reason
from .paged_loop import PagedLoopEngine

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
class PagedBatch:
    """The requests decoding in lockstep; row ``i`` of the block tables is ``request_ids[i]``."""

    request_ids: list[int]
    block_tables: torch.Tensor  # int32 [B, blocks of the longest request], on the device


FORWARDS = ("direct", "registry")


class PagedAttentionEngine(PagedLoopEngine):
    name = "paged-attention"
    chapter = "06"
    summary = "attention kernel reads KV through block tables: no gather step, no dense mask"
    # "paged-attention:registry" runs HF's modules with our attention plugged in by name;
    # "paged-attention:direct" our own forward over the same weights (see ``forward``).
    variant_option = "forward"
    variants = (*FORWARDS, "auto")

    def __init__(self, lm: LoadedModel, attention_backend: str | None = None,
                 forward: str = "auto", **kv_options: int | None) -> None:
        if has_sliding_window(lm.config):
            # Our kernels attend to the whole context; a windowed layer would silently read
            # tokens it must not see once a sequence outgrows the window.
            raise MiniInferError(f"{lm.name!r} has sliding-window attention layers, which the "
                                 f"paged attention kernels do not implement")
        super().__init__(lm, **kv_options)
        # Which model forward runs: HF's modules, our attention found through the registry
        # ("registry"), or DirectForward, the same ops without the module tree ("direct",
        # Llama/Qwen2 only; "auto" picks it wherever it applies).
        reason = unsupported_reason(self.model)
        if forward == "auto":
            forward = "registry" if reason else "direct"
        if forward not in FORWARDS:
            raise UnknownNameError(f"unknown forward {forward!r} for engine {self.name!r}; "
                                   f"forwards: {', '.join(FORWARDS)} (or auto)")
        if forward == "direct" and reason:
            raise MiniInferError(f"forward 'direct' cannot run {lm.name!r}: {reason}; "
                                 f"use forward='registry'")
        self.forward = forward
        self.direct = DirectForward(self.model) if forward == "direct" else None
        block_size = self.kv_cache.block_size
        self.backend = get_backend(attention_backend, self.device, block_size)
        # flash-attn only decodes; prompts then go to the best backend with a varlen kernel.
        self.prefill_backend = self.backend if self.backend.varlen else next(
            BACKENDS[name] for name in available_backends(self.device, block_size)
            if BACKENDS[name].varlen)
        self.staging = torch.empty(0, dtype=torch.int32)  # grown by stage()
        # Each layer's K and V views of the pool, made once rather than in every forward.
        self.layer_kv = [(k_cache, v_cache) for k_cache, v_cache in self.kv_cache.kv]
        if "triton" in (self.backend.name, self.prefill_backend.name) and \
                self.device.type == "cuda":
            # Every tile size compiled now: a JIT compile (1-3 s) must not land in a timed run.
            triton_attention.warm_up(*self.layer_kv[0], lm.config.num_attention_heads, lm.dtype)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        with attn_implementation(self.model, ATTN_IMPLEMENTATION):
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
        metadata = PagedAttentionMetadata(
            kv=self.layer_kv,
            block_tables=block_tables,
            context_lens=lens_t,
            slot_mapping=slot_mapping,
            backend=self.prefill_backend,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max(lens),
        )
        inputs = {
            "input_ids": torch.tensor([[t for p in prompts for t in p]], device=device),
            "position_ids": positions[None],
        }
        # Only each prompt's last position predicts a token.
        logits = self.model_forward(inputs, metadata, logits_to_keep=cu_seqlens_q[1:] - 1)
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
            inputs, metadata = self.prepare_inputs(batch, tokens)
        with phase("model_forward"):
            logits = self.model_forward(inputs, metadata)
        with phase("sample"):
            return sample(logits, params, generator)

    def prepare_inputs(self, batch: PagedBatch, tokens: torch.Tensor
                       ) -> tuple[dict[str, torch.Tensor], PagedAttentionMetadata]:
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
        staged = self.stage(context_lens + positions + slots + new_entries)
        context_lens, positions, slots, entries = staged.split(
            [len(slots)] * 3 + [len(new_entries)])
        if new_entries:
            rows, cols, blocks = entries.view(-1, 3).unbind(1)
            batch.block_tables[rows, cols] = blocks
        metadata = PagedAttentionMetadata(self.layer_kv, batch.block_tables, context_lens,
                                          slots.long(), self.backend)
        return {"input_ids": tokens[None], "position_ids": positions[None]}, metadata

    def stage(self, values: list[int]) -> torch.Tensor:
        """``values`` on the device, through the reused staging buffer in one copy (on a CPU
        the buffer itself). Rewriting the buffer next step is safe: every step ends with the
        clock's device synchronisation, so this copy is done by then."""
        if self.staging.numel() < len(values):
            # Pinned, the host-to-device copy is asynchronous (and faster); pinning is CUDA's.
            self.staging = torch.empty(2 * len(values), dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")
        host = self.staging[: len(values)]
        host.copy_(torch.tensor(values, dtype=torch.int32))
        return host.to(self.device, non_blocking=True)

    def model_forward(self, inputs: dict[str, torch.Tensor], metadata: PagedAttentionMetadata,
                      logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """Logits ``[B, V]`` at the positions ``logits_to_keep`` picks (0: every position, which
        in decode is one per request; or a tensor of token indices). No cache object: the K/V
        live in the pool."""
        if self.direct is not None:
            # Our callers keep every row (0) or name the rows (a tensor of token indices).
            rows = logits_to_keep if isinstance(logits_to_keep, torch.Tensor) else None
            return self.direct(inputs["input_ids"][0], inputs["position_ids"][0], metadata,
                               rows)
        return self.model(**inputs, use_cache=False, paged_attention=metadata,
                          logits_to_keep=logits_to_keep).logits[0]
