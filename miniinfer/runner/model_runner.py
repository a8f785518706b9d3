"""The model runner: one object owns the weights, the paged KV pool and the forward of a step.

nano-vllm and vLLM split a serving engine three ways: the scheduler decides which tokens run,
the model runner runs them, the engine loops. Chapter 08's continuous engine (and prefix caching
and the server above it) holds a :class:`ModelRunner` rather than inheriting a static-batch
engine; chapter 06's static engine uses one too, for its pool, its backends and its forward.

What the runner owns:

- the KV pool (:class:`~miniinfer.core.kv_cache.PagedKVCache`) and each layer's K/V views;
- the attention backends: one for decodes and one for prompts (flash-attn only decodes, so
  prompts then go to the best backend that has a varlen kernel);
- the forward, chosen by name from :data:`FORWARDS`: ``direct`` (our own Llama/Qwen2 model,
  :mod:`miniinfer.runner.model`, run eagerly: :mod:`miniinfer.runner.direct`), ``registry``
  (HF's module tree, our attention found by name) or ``compiled`` (chapter 11: the same model
  under ``torch.compile``, :mod:`miniinfer.runner.compiled`). Every forward has one signature, ``forward(input_ids
  [T], position_ids [T], metadata, logits_rows=None) -> logits [rows, vocab]``, so a new way
  to run the model (compiled, sharded over processes) is one more entry here, not one more
  engine subclass;
- the staging buffer: a step's per-token metadata reaches the device in one copy.

:meth:`ModelRunner.execute` is chapter 08's step: flatten the scheduled tokens of a mixed batch
(decodes first, then prompt chunks), stage their metadata, run the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from ..core.errors import MiniInferError, UnknownNameError
from ..core.kernels import BACKENDS, available_backends, get_backend, triton_attention
from ..core.kv_cache import KVCacheConfig, PagedKVCache
from ..core.models import LoadedModel
from ..core.ranges import phase
from ..core.scheduler import Request, ScheduledBatch
from .attention import (
    ATTN_IMPLEMENTATION,
    MixedBatchMetadata,
    PagedAttentionMetadata,
    attn_implementation,
    has_sliding_window,
)
from .direct import DirectForward, PagedAttend, unsupported_reason

if TYPE_CHECKING:
    from .compiled import CompileOptions

# forward(input_ids [T], position_ids [T], metadata, logits_rows [rows] or None) -> [rows, V]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, PagedAttend, torch.Tensor | None], torch.Tensor]


def registry_forward(runner: ModelRunner) -> ForwardFn:
    """HF's own modules, with :func:`~miniinfer.runner.attention.paged_attention_forward`
    plugged in by name (while :meth:`ModelRunner.paged_attention` is active)."""
    model = runner.model

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, metadata: PagedAttend,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        keep = 0 if logits_rows is None else logits_rows  # 0: every position
        return model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False,
                     paged_attention=metadata, logits_to_keep=keep).logits[0]

    return forward


def direct_forward(runner: ModelRunner) -> ForwardFn:
    reason = unsupported_reason(runner.model)
    if reason:
        raise MiniInferError(f"forward 'direct' cannot run {runner.lm.name!r}: {reason}; "
                             f"use forward='registry'")
    return DirectForward(runner.model)


def compiled_forward(runner: ModelRunner) -> ForwardFn:
    """Chapter 11: the direct forward under ``torch.compile`` (imported only when asked for:
    loading inductor costs seconds)."""
    from .compiled import CompiledForward

    reason = unsupported_reason(runner.model)
    if reason:
        raise MiniInferError(f"forward 'compiled' cannot run {runner.lm.name!r}: {reason}; "
                             f"use forward='registry'")
    return CompiledForward(runner.model, runner.kv_cache, runner.compile_options)


# Each forward the runner can run, by name: a factory that builds it for a runner.
FORWARDS: dict[str, Callable[[ModelRunner], ForwardFn]] = {
    "direct": direct_forward,
    "registry": registry_forward,
    "compiled": compiled_forward,
}


class ModelRunner:
    """Runs the model over paged K/V: ``forward`` for a batch of flattened tokens, ``execute``
    for a step the scheduler planned. ``forward``: a name in :data:`FORWARDS`, or ``"auto"``
    (``direct`` wherever it applies, else ``registry``)."""

    def __init__(self, lm: LoadedModel, kv_config: KVCacheConfig | None = None, *,
                 forward: str = "auto", attention_backend: str | None = None,
                 tensor_parallel: int = 1, compile_options: CompileOptions | None = None) -> None:
        if has_sliding_window(lm.config):
            # Our kernels attend to the whole context; a windowed layer would silently read
            # tokens it must not see once a sequence outgrows the window.
            raise MiniInferError(f"{lm.name!r} has sliding-window attention layers, which the "
                                 f"paged attention kernels do not implement")
        if forward == "auto":
            forward = "registry" if unsupported_reason(lm.model) else "direct"
        if forward not in FORWARDS:
            raise UnknownNameError(f"unknown forward {forward!r}; forwards: "
                                   f"{', '.join(FORWARDS)} (or auto)")
        self.lm = lm
        self.model = lm.model
        self.device = lm.device
        layout = None
        if tensor_parallel > 1:
            # Chapter 12: the layers split over N processes (this one is rank 0), each rank's
            # pool holding its own KV heads: this runner's pool is rank 0's.
            from .tensor_parallel import shard_layout

            if forward != "direct":
                raise MiniInferError(f"tensor_parallel={tensor_parallel} shards the direct "
                                     f"forward; forward {forward!r} cannot be sharded")
            layout = shard_layout(lm.config, tensor_parallel, repr(lm.name))
        # Allocated once, like a serving engine's KV pool: requests only borrow blocks from it.
        self.kv_cache = PagedKVCache(lm, kv_config,
                                     None if layout is None else layout.kv_heads_per_rank)
        # Each layer's K and V views of the pool, made once rather than in every forward.
        self.layer_kv = [(k_cache, v_cache) for k_cache, v_cache in self.kv_cache.kv]
        block_size = self.kv_cache.block_size
        self.backend = get_backend(attention_backend, self.device, block_size)
        # flash-attn only decodes; prompts then go to the best backend with a varlen kernel.
        self.prefill_backend = self.backend if self.backend.varlen else next(
            BACKENDS[name] for name in available_backends(self.device, block_size)
            if BACKENDS[name].varlen)
        self.forward_name = forward
        self.tensor_parallel = tensor_parallel
        self.compile_options = compile_options  # the compiled forward's (None: its defaults)
        if layout is not None:
            from .tensor_parallel import TensorParallelForward

            self.forward_name = f"direct, tensor-parallel {tensor_parallel}"
            self.forward = TensorParallelForward(lm, tensor_parallel, self.kv_cache.num_blocks,
                                                 block_size, pool=self.kv_cache.kv)
        else:
            self.forward: ForwardFn = FORWARDS[forward](self)
        self.staging = torch.empty(0, dtype=torch.int32)  # grown by stage()
        if "triton" in (self.backend.name, self.prefill_backend.name) and \
                self.device.type == "cuda":
            # Every tile size compiled now: a JIT compile (1-3 s) must not land in a timed run.
            triton_attention.warm_up(*self.layer_kv[0], lm.config.num_attention_heads, lm.dtype)

    def close(self) -> None:
        """End what the forward started (a tensor-parallel forward's worker processes)."""
        close = getattr(self.forward, "close", None)
        if close is not None:
            close()

    def paged_attention(self) -> AbstractContextManager[None]:
        """While active, HF's modules find our paged attention by name (the ``registry``
        forward needs it; the model is shared with other engines, so it is switched back)."""
        if self.forward_name != "registry":
            return nullcontext()
        return attn_implementation(self.model, ATTN_IMPLEMENTATION)

    def stage(self, values: list[int]) -> torch.Tensor:
        """``values`` on the device, through the reused staging buffer in one copy (on a CPU
        the buffer itself). Rewriting the buffer next step is safe: every step ends with a
        device synchronisation, so this copy is done by then."""
        if self.staging.numel() < len(values):
            # Pinned, the host-to-device copy is asynchronous (and faster); pinning is CUDA's.
            self.staging = torch.empty(2 * len(values), dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")
        host = self.staging[: len(values)]
        host.copy_(torch.tensor(values, dtype=torch.int32))
        return host.to(self.device, non_blocking=True)

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        """The forward of one scheduled step; returns the logits rows the step scores and the
        request of each row, in the same order: by default one row for each request that
        reached its last token (it samples); a request the batch scores at ``k + 1`` positions
        (``ScheduledBatch.num_scored``) has ``k + 1`` consecutive rows."""
        with phase("prepare_inputs"):
            ids, positions, metadata, logits_rows, sampled = self.prepare_mixed_batch(batch)
        with phase("model_forward"):
            return self.forward(ids, positions, metadata, logits_rows), sampled

    def prepare_mixed_batch(self, batch: ScheduledBatch) -> tuple[
            torch.Tensor, torch.Tensor, MixedBatchMetadata, torch.Tensor, list[Request]]:
        """Flatten the scheduled tokens (decodes first) and send their ids, positions, slots,
        context lens, chunk boundaries, logits rows and block tables in one staged copy. Only
        the positions the batch scores go through the LM head (by default the last position of
        a request that reaches the end of its tokens); a partial prompt chunk only fills the
        cache."""
        manager = self.kv_cache.block_manager
        block_size = manager.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        for request, n in batch.scheduled:
            start = request.num_computed_tokens
            end = start + n
            table = manager.block_tables[request.request_id]
            ids += request.token_ids(start, end)
            positions += range(start, end)
            slots += [table[t // block_size] * block_size + t % block_size
                      for t in range(start, end)]
            context_lens.append(end)
            tables.append(table)
            scored = batch.scored(request, n)
            logits_rows += range(len(ids) - scored, len(ids))
            sampled += [request] * scored
        num_decodes = batch.num_decodes
        chunk_lens = [n for _, n in batch.scheduled[num_decodes:]]
        cu_seqlens_q = [0, *accumulate(chunk_lens)]
        width = max(len(table) for table in tables)
        staged = self.stage(ids + positions + slots + context_lens + cu_seqlens_q + logits_rows
                            + [b for table in tables for b in table + [0] * (width - len(table))])
        num_tokens = len(ids)
        (ids_t, positions_t, slots_t, context_lens_t, cu_seqlens_t, rows_t,
         tables_t) = staged.split([num_tokens] * 3 + [len(tables), len(cu_seqlens_q),
                                                      len(logits_rows), len(tables) * width])
        slots_t = slots_t.long()
        block_tables = tables_t.view(len(tables), width)
        kv = self.layer_kv
        decodes = PagedAttentionMetadata(
            kv, block_tables[:num_decodes], context_lens_t[:num_decodes], slots_t[:num_decodes],
            self.backend) if num_decodes else None
        chunks = PagedAttentionMetadata(
            kv, block_tables[num_decodes:], context_lens_t[num_decodes:],
            slots_t[num_decodes:], self.prefill_backend, cu_seqlens_q=cu_seqlens_t,
            max_seqlen_q=max(chunk_lens)) if chunk_lens else None
        metadata = MixedBatchMetadata(num_decodes, decodes, chunks)
        return ids_t, positions_t, metadata, rows_t, sampled
