"""Chapter 07's CUDA graphs in the runner: a serving engine's decode steps replayed, not launched.

Chapter 07 captured the decode step of a static batch. A serving engine's batch changes every
step (requests join, finish, run prompt chunks), so the runner captures by batch size instead,
as nano-vllm and vLLM do: a step of ``B`` decodes and nothing else is copied into the static
buffers of the smallest bucket that holds it and replays that bucket's graph; rows past ``B``
are padding that read and write one scratch block. A step with prompt chunks, or one that
scores several positions of a request, runs eagerly: its token count varies too much to
capture, and on a GPU its work is large beside the launch cost a graph saves.

The captured function is the runner's own forward over a :class:`StepBatch` of the static
buffers; its attention gets a host bound on the context (the whole table), so nothing in it
reads the device back. Buckets are captured on first use, each from a side stream after two
warm-up runs (torch.cuda.graph's rule), into one shared memory pool. ``emulate=True`` runs the
same buffers and padding with no graph at all: the CPU's check of everything but the capture.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.kernels import AttentionBackend
from ..core.kv_cache import PagedKVCache, blocks_for
from .step import StepBatch, decode_batch

# Batch sizes a decode graph is captured for; a step runs in the smallest that holds it.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The KV block padding rows read and write (taken from the pool once, at the first capture).
SCRATCH_REQUEST = "cuda-graph scratch"


def capture_unworthy_reason(device: torch.device, backend: AttentionBackend) -> str | None:
    """Why decode steps on ``device`` with ``backend`` are not captured (None: they are)."""
    if device.type != "cuda":
        return "CUDA graphs are CUDA's"
    if backend.plan_decode is not None:
        # The torch reference's decode reads only the blocks the longest request uses, a bound
        # a captured graph cannot follow: captured, it would gather the whole table each step.
        return f"attention backend {backend.name!r} is not worth capturing"
    return None


def capture(fn: Callable[[], torch.Tensor], device: torch.device,
            pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn`` captured into a CUDA graph (with ``pool``'s memory) -> the graph and the output
    tensor each replay rewrites. Warmed up twice on a side stream first (kernel compilation,
    cuBLAS workspaces), as torch.cuda.graph asks."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class StaticDecode:
    """One bucket's static step: a :class:`StepBatch` of ``size`` decodes whose tensors every
    replay refills, and the graph (or, emulated, nothing) that runs the forward over it."""

    def __init__(self, forward: Callable[[StepBatch], torch.Tensor], kv_cache: PagedKVCache,
                 size: int, width: int, scratch: int, emulate: bool, pool) -> None:
        device = kv_cache.kv.device
        block_size = kv_cache.block_size
        self.scratch, self.scratch_slot = scratch, scratch * block_size
        self.tables = torch.full((size, width), scratch, dtype=torch.int32, device=device)
        self.batch = decode_batch(
            torch.zeros(size, dtype=torch.long, device=device),
            torch.zeros(size, dtype=torch.long, device=device),
            torch.full((size,), self.scratch_slot, dtype=torch.long, device=device),
            self.tables, torch.ones(size, dtype=torch.int32, device=device),
            # A host bound baked into the graph, so it holds for every replay: the whole table.
            max_context_len=width * block_size)
        self.run = lambda: forward(self.batch)
        self.graph = None
        if emulate:
            self.logits = None
        else:
            self.graph, self.logits = capture(self.run, device, pool)

    def replay(self, step: StepBatch) -> torch.Tensor:
        """``step``'s decodes copied in (the other rows padding), run -> its logits ``[B, V]``."""
        batch, n = self.batch, step.num_tokens
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            getattr(batch, name)[:n].copy_(getattr(step, name))
        # Padding rows: one scratch slot to write, one cached token of the scratch block to read.
        batch.input_ids[n:].fill_(0)
        batch.positions[n:].fill_(0)
        batch.slot_mapping[n:].fill_(self.scratch_slot)
        batch.context_lens[n:].fill_(1)
        self.tables.fill_(self.scratch)
        width = step.block_tables.shape[1]
        self.tables[:n, :width].copy_(step.block_tables)
        if self.graph is None:
            return self.run()[:n]
        self.graph.replay()
        return self.logits[:n].clone()  # the next replay rewrites the output


class DecodeGraphs:
    """The runner's decode steps under CUDA graphs, one per batch-size bucket (see the module
    docstring); ``fits`` says whether a step can replay one, ``replay`` runs it."""

    def __init__(self, forward: Callable[[StepBatch], torch.Tensor], kv_cache: PagedKVCache,
                 max_context: int, emulate: bool = False,
                 buckets: tuple[int, ...] = GRAPH_BUCKETS) -> None:
        self.kv_cache, self.emulate = kv_cache, emulate
        self.forward = forward  # what is captured
        self.buckets = buckets
        self.width = blocks_for(max_context, kv_cache.block_size)
        self.graphs: dict[int, StaticDecode] = {}
        self.pool = None

    def fits(self, step: StepBatch) -> bool:
        """Whether ``step`` is decodes only, one scored row each, in a bucket's size."""
        n = step.num_tokens
        return (step.num_chunks == 0 and step.num_decodes == n and n <= self.buckets[-1]
                and (step.logits_rows is None or step.logits_rows.shape[0] == n)
                and step.block_tables.shape[1] <= self.width)

    def replay(self, step: StepBatch) -> torch.Tensor:
        """Logits ``[B, V]`` of a step that :meth:`fits`, from its bucket's graph."""
        size = next(b for b in self.buckets if b >= step.num_tokens)
        if size not in self.graphs:
            self.graphs[size] = self.static(size)
        return self.graphs[size].replay(step)

    def static(self, size: int) -> StaticDecode:
        """Bucket ``size``'s static step, captured (or, emulated, built) now."""
        manager = self.kv_cache.block_manager
        if SCRATCH_REQUEST not in manager:
            manager.add(SCRATCH_REQUEST, self.kv_cache.block_size)
        if self.pool is None and not self.emulate:
            self.pool = torch.cuda.graph_pool_handle()  # buckets share one memory pool
        scratch = manager.block_tables[SCRATCH_REQUEST][0]
        with torch.inference_mode():
            return StaticDecode(self.forward, self.kv_cache, size, self.width, scratch,
                                self.emulate, self.pool)
