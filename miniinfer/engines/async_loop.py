"""Stage ``async``: take the host off the decode loop's critical path (chapter 07).

``paged-attention`` still asks the host for every step: the block manager (Python) takes a slot
per request, the metadata is packed and copied to the device, and the step ends by reading the
sampled tokens back, which waits for the device to finish. On a GPU that wait drains the queue:
the device idles while Python builds and launches the next step's few hundred kernels.

This stage changes three things, one per execution loop (``loop=``):

- ``sync``: every block a request can use is taken when it is admitted (a static batch knows
  each request's last position: prompt + ``max_new_tokens``), so a decode step's metadata is
  pure device arithmetic on state kept on the device: position = tokens cached so far, slot =
  ``block_table[position // block_size] * block_size + position % block_size``, then the
  context length goes up by one. Steps still run prepare -> forward -> sample -> copy back, one
  after the other.
- ``overlap``: the step after next is launched before this step's tokens are read. Tokens go
  to a pinned host buffer with a ``non_blocking`` copy on a side stream, ordered after the step
  by a CUDA event; the host reads step ``n`` (EOS checks, timestamps) while the device runs step
  ``n + 1``. The only wait is for tokens already copied. The price: a token reaches the host one
  step later than it could, and the step after the last one (when every request has stopped on
  EOS) is computed for nothing.
- ``cuda-graph``: the decode step (metadata, forward, logits) is captured once per batch-size
  bucket into a CUDA graph over static buffers and replayed; a batch is padded to its bucket
  with rows that read and write one scratch block. Prefill and sampling stay eager. One replay
  launches the whole step, so the host cost per step no longer grows with the kernel count.

On a CPU every op has finished when it returns, so there is no queue to keep full: ``overlap``
runs the same lagged loop (useful to test, one step of extra latency, nothing gained) and
``cuda-graph`` falls back to it. It falls back there on a GPU too (with a warning) when
attention is the torch reference: the reference's decode reads only the blocks the longest
request uses, a bound a captured graph cannot follow, so captured it would gather the whole
table every step. On CUDA no decode step reads anything back from the device, for any
backend: the reference gets that bound from the host (``DecodeState.max_context_len``) and
masks the positions past each context, and sampling draws without a host check. ``loop="auto"`` picks ``cuda-graph`` on CUDA, ``sync``
elsewhere. The outputs of every loop are the same tokens.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..core.errors import UnknownNameError
from ..core.kernels import AttentionBackend
from ..core.kv_cache import blocks_for
from ..core.models import LoadedModel
from ..core.ranges import READ_TOKENS, phase
from ..core.sampling import SamplingParams, make_generator, sample
from ..runner import StepBatch, decode_batch
from ..runner.cuda_graphs import GRAPH_BUCKETS, SCRATCH_REQUEST, capture, capture_unworthy_reason
from .base import GenerationResult, StepClock, trim_at_eos
from .paged_attention import PagedAttentionEngine

LOOPS = ("sync", "overlap", "cuda-graph")


@dataclass(slots=True)
class DecodeState:
    """What a decode step reads and advances, all on the device; row ``i`` is request ``i``."""

    block_tables: torch.Tensor  # int32 [B, W]: every block each request will use
    context_lens: torch.Tensor  # int32 [B]: tokens cached so far (+1 per step)
    rows: torch.Tensor  # int64 [B]: arange, to pick each row's block
    # On the host: a bound on context_lens (the longest prompt + steps so far, at most the
    # whole table), so the torch reference's decode plan never reads the lens back.
    max_context_len: int


def choose_loop(loop: str, device: torch.device, backend: AttentionBackend) -> tuple[str, str]:
    """The loop asked for (``auto`` resolved) and the loop that runs on ``device`` with this
    attention backend (see the module docstring)."""
    cuda = device.type == "cuda"
    if loop == "auto":
        loop = "cuda-graph" if cuda else "sync"
    if loop not in LOOPS:
        raise UnknownNameError(f"unknown loop {loop!r} for engine 'async'; loops: "
                               f"{', '.join(LOOPS)} (or auto)")
    if loop != "cuda-graph":
        return loop, loop
    if not cuda:  # streams and graphs are CUDA's
        return loop, "overlap"
    reason = capture_unworthy_reason(device, backend)
    if reason is not None:
        warnings.warn(f"async: {reason} in a CUDA graph; running loop 'overlap' instead",
                      RuntimeWarning, stacklevel=3)
        return loop, "overlap"
    return loop, loop


class AsyncEngine(PagedAttentionEngine):
    name = "async"
    summary = "decode metadata made on the device; overlapped copies; CUDA graphs on a GPU"
    # ``make_engine("async:overlap", lm)`` is ``make_engine("async", lm, loop="overlap")``.
    variant_option = "loop"
    variants = (*LOOPS, "auto")

    def __init__(self, lm: LoadedModel, loop: str = "auto", attention_backend: str | None = None,
                 **kv_options: int | None) -> None:
        super().__init__(lm, attention_backend, **kv_options)
        self.requested_loop, self.loop = choose_loop(loop, self.device, self.runner.backend)
        self.graphs: dict[int, DecodeGraph] = {}
        self.graph_pool = None

    def take_blocks(self, request_ids: list[int], prompts: list[list[int]],
                    params: SamplingParams) -> None:
        """All the blocks each request can reach: its prompt and every fed token (the last
        sampled one is never fed). A static batch knows this at admission, and it leaves no
        bookkeeping for the host to do in a decode step."""
        for rid, prompt in zip(request_ids, prompts, strict=True):
            self.kv_cache.block_manager.add(rid, len(prompt) + params.max_new_tokens - 1)

    def _run(self, request_ids: list[int], prompts: list[list[int]],
             params: SamplingParams) -> GenerationResult:
        generator = make_generator(params, self.device)
        clock = StepClock(self.device)
        with phase("prefill"):
            batch, logits = self.prefill(request_ids, prompts, params)
            tokens = sample(logits, params, generator)
        state = DecodeState(
            batch.block_tables,
            torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=self.device),
            torch.arange(len(prompts), device=self.device),
            max(len(p) for p in prompts),
        )
        if self.loop == "cuda-graph" and len(prompts) <= GRAPH_BUCKETS[-1]:
            graph = self.decode_graph(len(prompts))
            graph.load(state)
            step = partial(self.graph_step, graph, params=params, generator=generator)
        else:
            step = partial(self.decode_step, state, params=params, generator=generator)
        run_loop = self.run_sync if self.loop == "sync" else self.run_overlapped
        rows = run_loop(tokens, step, params, clock)
        # Steps were collected as rows of the batch; a request's tokens are a column.
        token_ids = [list(column) for column in zip(*rows, strict=True)]
        return clock.finish(trim_at_eos(token_ids,
                                        None if params.ignore_eos else self.lm.eos_token_id))

    # -- the loops ------------------------------------------------------------------------

    def run_sync(self, tokens: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor],
                 params: SamplingParams, clock: StepClock) -> list[list[int]]:
        """Each step's tokens are read back before the next step starts."""
        finished = torch.zeros(len(tokens), dtype=torch.bool, device=self.device)
        done = [False] * len(tokens)
        rows = []
        for n in range(params.max_new_tokens):
            if n > 0:
                with phase("decode_step"):
                    tokens = step(tokens)
            tokens = self.mask_finished(tokens, finished, params)
            with phase(READ_TOKENS):
                rows.append(tokens.tolist())  # waits for the step: the loop's one sync
            clock.stamp()
            if self.all_done(rows[-1], done, params):
                break
        return rows

    def run_overlapped(self, tokens: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor],
                       params: SamplingParams, clock: StepClock) -> list[list[int]]:
        """Step ``n + 1`` is queued before step ``n``'s tokens are read (module docstring)."""
        cuda = self.device.type == "cuda"
        copy_stream = torch.cuda.Stream(self.device) if cuda else None
        # Two host buffers: one being filled by the newest step's copy, one being read.
        host = [torch.empty(len(tokens), dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        finished = torch.zeros(len(tokens), dtype=torch.bool, device=self.device)
        done = [False] * len(tokens)
        rows: list[list[int]] = []
        pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

        def collect(buffer: torch.Tensor, copied: torch.cuda.Event | None) -> bool:
            with phase(READ_TOKENS):
                if copied is not None:
                    copied.synchronize()  # waits for that copy only, not the steps after it
                rows.append(buffer.tolist())
            clock.stamp()
            return self.all_done(rows[-1], done, params)

        for n in range(params.max_new_tokens):
            if n > 0:
                with phase("decode_step"):
                    tokens = step(tokens)
            tokens = self.mask_finished(tokens, finished, params)
            buffer = host[n % 2]
            copied = None
            if cuda:
                # The copy waits for this step on the side stream; the main stream goes on.
                copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(copy_stream):
                    buffer.copy_(tokens, non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(copy_stream)
                # The allocator must not reuse ``tokens`` before the side stream has read it.
                tokens.record_stream(copy_stream)
            else:
                buffer.copy_(tokens)
            # While the device runs step n, the host reads step n - 1.
            if pending is not None and collect(*pending):
                pending = None  # everyone stopped at n - 1: step n only emitted padding
                break
            pending = (buffer, copied)
        if pending is not None:
            collect(*pending)
        return rows

    def all_done(self, row: list[int], done: list[bool], params: SamplingParams) -> bool:
        """Mark rows that emitted EOS in this step's tokens (on the host); True when every
        row has."""
        if params.ignore_eos:
            return False
        eos = self.lm.eos_token_id
        for i, token in enumerate(row):
            done[i] = done[i] or token == eos
        return all(done)

    # -- one decode step --------------------------------------------------------------------

    def decode_step(self, state: DecodeState, tokens: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator | None) -> torch.Tensor:
        logits = self.forward_step(state, tokens)
        with phase("sample"):
            return sample(logits, params, generator)

    def forward_step(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each row's last token; returns logits ``[B, V]``. Device ops only: this is what
        a CUDA graph captures."""
        with phase("prepare_inputs"):
            step = self.prepare_inputs(state, tokens)
        with phase("model_forward"):
            return self.model_forward(step)

    def prepare_inputs(self, state: DecodeState, tokens: torch.Tensor) -> StepBatch:
        """This step's positions and slots, from the state alone (no host values)."""
        block_size = self.kv_cache.block_size
        positions = state.context_lens.long()  # a copy: the fed token's position
        blocks = state.block_tables[state.rows, positions // block_size].long()
        slots = blocks * block_size + positions % block_size
        state.context_lens += 1  # in place, so a captured graph advances it on every replay
        state.max_context_len = min(state.max_context_len + 1,
                                    state.block_tables.shape[1] * block_size)
        return decode_batch(tokens, positions, slots, state.block_tables, state.context_lens,
                            token_rows=state.rows, max_context_len=state.max_context_len)

    # -- CUDA graphs --------------------------------------------------------------------------

    def graph_step(self, graph: DecodeGraph, tokens: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None) -> torch.Tensor:
        with phase("model_forward"):
            logits = graph.replay(tokens)
        with phase("sample"):
            return sample(logits, params, generator)

    def decode_graph(self, batch_size: int) -> DecodeGraph:
        """The graph of the smallest bucket holding ``batch_size`` rows, captured on first use."""
        size = next(b for b in GRAPH_BUCKETS if b >= batch_size)
        if size not in self.graphs:
            block_manager = self.kv_cache.block_manager
            if SCRATCH_REQUEST not in block_manager:
                block_manager.add(SCRATCH_REQUEST, self.kv_cache.block_size)
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()  # buckets share one pool
            self.graphs[size] = DecodeGraph(self, size)
        return self.graphs[size]


class DecodeGraph:
    """One decode step captured for ``size`` rows, over static buffers that each generate call
    loads its batch into. Padding rows point every block table entry at the scratch block, so
    what they write lands there and what they read is never used."""

    def __init__(self, engine: AsyncEngine, size: int) -> None:
        device = engine.device
        self.scratch = engine.kv_cache.block_manager.block_tables[SCRATCH_REQUEST][0]
        self.state = graph_state(engine, size, self.scratch)
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.graph, self.logits = capture(partial(engine.forward_step, self.state, self.tokens),
                                          device, engine.graph_pool)
        self.batch_size = 0

    def load(self, state: DecodeState) -> None:
        """Copy a batch's decode state into the static buffers; the rest become padding."""
        batch, width = state.block_tables.shape
        self.state.block_tables.fill_(self.scratch)
        self.state.block_tables[:batch, :width] = state.block_tables
        self.state.context_lens.zero_()
        self.state.context_lens[:batch] = state.context_lens
        self.batch_size = batch

    def replay(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run one step for the loaded batch fed ``tokens``; returns its logits ``[B, V]``."""
        self.tokens[: self.batch_size] = tokens
        self.graph.replay()
        return self.logits[: self.batch_size]


def graph_state(engine: AsyncEngine, size: int, scratch: int) -> DecodeState:
    """The static decode state a graph of ``size`` rows is captured over: tables as wide as
    the longest context the model allows, every entry the scratch block until a batch loads."""
    device = engine.device
    block_size = engine.kv_cache.block_size
    width = blocks_for(engine.lm.max_context, block_size)
    return DecodeState(
        torch.full((size, width), scratch, dtype=torch.int32, device=device),
        torch.zeros(size, dtype=torch.int32, device=device),
        torch.arange(size, device=device),
        # A host value is baked into the graph, so it must hold for every replay: the whole
        # table (only the torch reference reads it, and it is never captured).
        width * block_size,
    )
