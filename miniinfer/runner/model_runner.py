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
  under ``torch.compile``, :mod:`miniinfer.runner.compiled`). Every forward has one signature,
  ``forward(batch: StepBatch) -> logits [rows, vocab]`` (:mod:`miniinfer.runner.step`), so a
  new way to run the model (compiled, sharded over processes) is one more entry here, not one
  more engine subclass;
- the staging buffer: a step's per-token metadata reaches the device in one copy;
- on a GPU, CUDA graphs of decode-only steps, one per batch-size bucket
  (:mod:`miniinfer.runner.cuda_graphs`).

:meth:`ModelRunner.execute` is chapter 08's step: flatten the scheduled tokens of a mixed batch
(decodes first, then prompt chunks) into a step batch, staged in one copy, and run the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from ..core.config import EngineConfig
from ..core.errors import MiniInferError
from ..core.kernels import AttentionBackend, triton_attention
from ..core.kv_cache import BlockManager, KVCacheConfig, PagedKVCache
from ..core.models import LoadedModel
from ..core.ranges import phase
from ..core.scheduler import StepPlan
from .attention import ATTN_IMPLEMENTATION, PagedAttention, attn_implementation, has_sliding_window
from .cuda_graphs import DecodeGraphs, capture_unworthy_reason
from .direct import DirectForward, unsupported_reason
from .step import StepBatch

if TYPE_CHECKING:
    from .compiled import CompileOptions

# forward(batch) -> logits [rows, V], the rows batch.logits_rows picks (None: every token)
ForwardFn = Callable[[StepBatch], torch.Tensor]


def registry_forward(runner: ModelRunner) -> ForwardFn:
    """HF's own modules, with :func:`~miniinfer.runner.attention.paged_attention_forward`
    plugged in by name (while :meth:`ModelRunner.paged_attention` is active)."""
    model, attention = runner.model, runner.attention

    def forward(batch: StepBatch) -> torch.Tensor:
        keep = 0 if batch.logits_rows is None else batch.logits_rows  # 0: every position
        return model(input_ids=batch.input_ids[None], position_ids=batch.positions[None],
                     use_cache=False, paged_attention=attention.prepare(batch),
                     logits_to_keep=keep).logits[0]

    return forward


def direct_forward(runner: ModelRunner) -> ForwardFn:
    reason = unsupported_reason(runner.lm.model)
    if reason:
        raise MiniInferError(f"forward 'direct' cannot run {runner.lm.name!r}: {reason}; "
                             f"use forward='registry'")
    return DirectForward(runner.model, runner.attention)


def compiled_forward(runner: ModelRunner) -> ForwardFn:
    """Chapter 11: the direct forward under ``torch.compile`` (imported only when asked for:
    loading inductor costs seconds)."""
    from .compiled import CompiledForward

    reason = unsupported_reason(runner.lm.model)
    if reason:
        raise MiniInferError(f"forward 'compiled' cannot run {runner.lm.name!r}: {reason}; "
                             f"use forward='registry'")
    return CompiledForward(runner.model, runner.kv_cache, runner.compile_options,
                           attention=runner.attention)


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
                 tensor_parallel: int = 1, compile_options: CompileOptions | None = None,
                 weights: str = "dense", cuda_graphs: bool = True,
                 block_manager: type[BlockManager] = BlockManager) -> None:
        if has_sliding_window(lm.config):
            # Our kernels attend to the whole context; a windowed layer would silently read
            # tokens it must not see once a sequence outgrows the window.
            raise MiniInferError(f"{lm.name!r} has sliding-window attention layers, which the "
                                 f"paged attention kernels do not implement")
        # The same checks a config makes, for a runner built without one.
        EngineConfig(forward=forward, tensor_parallel=tensor_parallel, weights=weights)
        if forward == "auto":
            forward = "registry" if unsupported_reason(lm.model) else "direct"
        self.lm = lm
        self.device = lm.device
        self.weights = weights
        # 1. The model: HF's weights, or ours with every linear swapped for a quantized one
        # (chapter 13); every forward below runs whichever it is given.
        self.model = lm.model
        # What a decode step reads of a quantized model (codes and scales): its bandwidth
        # floor, not the dense one (None: the model's own weights).
        self.weight_bytes: int | None = None
        if weights != "dense":
            from .quantized import quantized, quantized_compile_options, weight_bytes

            try:
                self.model = quantized(lm, weights)
            except ValueError as error:
                raise MiniInferError(str(error)) from None
            compile_options = quantized_compile_options(compile_options)
            self.weight_bytes = weight_bytes(self.model)
        layout = None
        if tensor_parallel > 1:
            # Chapter 12: the layers split over N processes (this one is rank 0), each rank's
            # pool holding its own KV heads: this runner's pool is rank 0's.
            from .tensor_parallel import shard_layout

            layout = shard_layout(lm.config, tensor_parallel, repr(lm.name))
        # Allocated once, like a serving engine's KV pool: requests only borrow blocks from it.
        self.kv_cache = PagedKVCache(lm, kv_config,
                                     None if layout is None else layout.kv_heads_per_rank,
                                     block_manager)
        # Each layer's K and V views of the pool, made once rather than in every forward.
        self.layer_kv = [(k_cache, v_cache) for k_cache, v_cache in self.kv_cache.kv]
        block_size = self.kv_cache.block_size
        self.attention = PagedAttention.over(self.layer_kv, self.device, block_size,
                                             attention_backend)
        self.forward_name = forward
        self.tensor_parallel = tensor_parallel
        self.compile_options = compile_options  # the compiled forward's (None: its defaults)
        # 2. The forward over that model, on this rank or on every rank.
        if layout is not None:
            from .tensor_parallel import TensorParallelForward

            self.forward_name = f"direct, tensor-parallel {tensor_parallel}"
            self.forward = TensorParallelForward(lm, tensor_parallel, self.kv_cache.num_blocks,
                                                 block_size, pool=self.kv_cache.kv,
                                                 attention_backend=self.backend.name)
        else:
            self.forward: ForwardFn = FORWARDS[forward](self)
        self.staging = torch.empty(0, dtype=torch.int32)  # grown by stage()
        # 3. Chapter 07's CUDA graphs for decode-only steps, where the forward is eager and ours
        # (the compiled forward has inductor's own; a sharded step's collectives stay eager).
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graphs and isinstance(self.forward, DirectForward) and \
                capture_unworthy_reason(self.device, self.backend) is None:
            self.decode_graphs = DecodeGraphs(self.forward, self.kv_cache, lm.max_context)
        if "triton" in (self.backend.name, self.prefill_backend.name) and \
                self.device.type == "cuda":
            # Every tile size compiled now: a JIT compile (1-3 s) must not land in a timed run.
            triton_attention.warm_up(*self.layer_kv[0], lm.config.num_attention_heads, lm.dtype)

    @classmethod
    def of(cls, lm: LoadedModel, config: EngineConfig,
           block_manager: type[BlockManager] = BlockManager) -> ModelRunner:
        """The runner ``config`` describes, its pool's blocks kept by ``block_manager`` (chapter
        09's remembers prefixes); a compiled forward warmed up if the config says so."""
        runner = cls(lm, config.kv_cache, forward=config.forward,
                     attention_backend=config.attention_backend,
                     tensor_parallel=config.tensor_parallel,
                     compile_options=config.compile_options, weights=config.weights,
                     cuda_graphs=config.cuda_graphs, block_manager=block_manager)
        if config.warm_up:
            runner.warm_up()
        return runner

    def warm_up(self) -> None:
        """Compile what the forward compiles (every bucket), so no step waits on it."""
        if self.forward_name == "compiled":
            self.forward.warm_up()

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend decodes run with."""
        return self.attention.backend

    @property
    def prefill_backend(self) -> AttentionBackend:
        """The attention backend prompt chunks run with."""
        return self.attention.prefill_backend

    def close(self) -> None:
        """End what the forward started (a tensor-parallel forward's worker processes)."""
        close = getattr(self.forward, "close", None)
        if close is not None:
            close()

    def check_alive(self) -> None:
        """Raise if the forward has lost a process it needs (a tensor-parallel rank)."""
        if self.tensor_parallel > 1:
            self.forward.check_alive()

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

    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, list[int]]:
        """The forward of one scheduled step; returns the logits rows the step scores and, for
        each row in the same order, the index of its request in ``plan.requests``: by default
        one row for each request that reached its last token (it samples); a request scored at
        ``k + 1`` positions has ``k + 1`` consecutive rows."""
        with phase("prepare_inputs"):
            step, rows = self.prepare_step(plan)
        with phase("model_forward"):
            graphs = self.decode_graphs
            if graphs is not None and graphs.fits(step):
                return graphs.replay(step), rows
            return self.forward(step), rows

    def prepare_step(self, plan: StepPlan) -> tuple[StepBatch, list[int]]:
        """Flatten the scheduled tokens (decodes first) into a step batch, its tensors sent in
        one staged copy, and the request index of each scored row. Only the positions the
        plan scores go through the LM head; a partial prompt chunk only fills the cache."""
        block_size = self.kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        token_rows: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        scored_rows: list[int] = []
        for row, request in enumerate(plan.requests):
            start, end, table = request.start, request.end, request.block_table
            ids += request.token_ids
            positions += range(start, end)
            slots += [table[t // block_size] * block_size + t % block_size
                      for t in range(start, end)]
            token_rows += [row] * (end - start)
            context_lens.append(end)
            tables.append(table)
            logits_rows += range(len(ids) - request.num_scored, len(ids))
            scored_rows += [row] * request.num_scored
        num_decodes = plan.num_decodes
        chunk_lens = [len(r.token_ids) for r in plan.requests[num_decodes:]]
        query_starts = [0, *accumulate(chunk_lens)] if chunk_lens else []
        width = max(len(table) for table in tables)
        staged = self.stage(ids + positions + slots + token_rows + context_lens + query_starts
                            + logits_rows
                            + [b for table in tables for b in table + [0] * (width - len(table))])
        num_tokens = len(ids)
        (ids_t, positions_t, slots_t, rows_t, context_lens_t, starts_t, logits_t,
         tables_t) = staged.split([num_tokens] * 4 + [len(tables), len(query_starts),
                                                      len(logits_rows), len(tables) * width])
        step = StepBatch(ids_t, positions_t, slots_t.long(), tables_t.view(len(tables), width),
                         context_lens_t, rows_t, num_decodes,
                         query_starts=starts_t if chunk_lens else None,
                         max_query_len=max(chunk_lens, default=1), logits_rows=logits_t)
        return step, scored_rows
