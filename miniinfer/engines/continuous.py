"""Stage ``continuous``: continuous batching with chunked prefill and preemption.

Every stage so far ran one static batch: prefill all prompts, decode in lockstep until the
longest request is done. Here requests come and go at every step (see :mod:`miniinfer.scheduler`
for the policy); this module is the step that carries a decision out:

- ``add_request`` queues a request (its own sampling parameters, seed and stop strings);
  ``step`` schedules, runs one forward and samples; ``abort`` drops a request and frees its
  blocks. ``generate`` (the interface every stage shares) is these three in a loop.
- one forward holds every scheduled request's new tokens as one flat sequence, exactly like the
  paged-attention prefill of chapter 06, but now decodes (one token) and prompt chunks (many)
  sit side by side, each request with its own positions, context length and block table.
- attention is chapter 06's, per part: the decodes go through the decode kernel and the chunks
  through the varlen kernel, which lets a chunk's queries see the earlier chunks of its prompt
  already in the cache. Splitting matters on a CPU, where the reference varlen kernel pads
  every request to the longest query: one 256-token chunk would make 31 decodes cost 256 query
  rows each.
- only the last position of a request that reaches the end of its tokens goes through the LM
  head; a partial prompt chunk only fills the cache.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from ..devices import sync
from ..errors import InvalidRequestError, MiniInferError
from ..kv_cache import RequestId, blocks_for
from ..models import LoadedModel
from ..ranges import phase
from ..sampling import SamplingParams, make_generator, sample
from ..scheduler import (
    FinishReason,
    Request,
    RequestTimeline,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
)
from .base import GenerationResult
from .paged_attention import (
    ATTN_IMPLEMENTATION,
    PagedAttentionEngine,
    PagedAttentionMetadata,
    attn_implementation,
)


@dataclass(slots=True)
class MixedBatchMetadata:
    """One step's forward: the first ``num_decodes`` tokens are decodes (one per request), the
    rest prompt chunks; each part carries chapter 06's metadata, or None when the step has none
    of that kind. It has chapter 06's ``attend``, so it goes wherever that metadata goes: to
    the direct forward, or down HF's modules to the registered paged attention."""

    num_decodes: int
    decodes: PagedAttentionMetadata | None
    chunks: PagedAttentionMetadata | None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Chapter 06's ``attend`` on the decode rows and on the chunk rows separately
        (``[T, heads, head_dim]`` in and out)."""
        n = self.num_decodes
        parts = [meta.attend(layer_idx, q[rows], k[rows], v[rows], scale)
                 for meta, rows in ((self.decodes, slice(None, n)), (self.chunks, slice(n, None)))
                 if meta is not None]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(slots=True)
class StepResult:
    """What one ``step`` did. ``outputs`` are the requests that got a token (read them, do not
    change them); finished ones among them have ``finished`` set and have left the engine."""

    start: float
    end: float
    num_decodes: int  # requests fed one token (a decode, or a one-token prompt chunk)
    num_prefill_tokens: int  # the other tokens: prompt chunks, recomputation after preemption
    preempted: list[RequestId]
    outputs: list[Request]
    num_blocks_in_use: int  # held by requests after the step
    num_blocks_cached: int  # free, but still holding a reusable prefix (chapter 09)


def sample_next_tokens(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token per row of ``logits`` [k, V], each request with its own parameters and
    generator: one argmax serves every greedy row, sampled rows are drawn one by one."""
    tokens = logits.argmax(dim=-1)
    for row, request in enumerate(requests):
        if not request.params.greedy:
            tokens[row] = sample(logits[row : row + 1], request.params, request.generator)[0]
    return tokens.tolist()  # the step's one host sync


class ContinuousEngine(PagedAttentionEngine):
    name = "continuous"
    chapter = "08"
    summary = "continuous batching: token-budget scheduler, chunked prefill, preemption"
    variants = ()  # it still takes forward=, like chapter 06's stage; no named variants

    def __init__(self, lm: LoadedModel, max_num_batched_tokens: int = 512,
                 max_num_seqs: int = 256, chunked_prefill: bool = True,
                 attention_backend: str | None = None, **kv_options: int | None) -> None:
        super().__init__(lm, attention_backend, **kv_options)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens, max_num_seqs, chunked_prefill),
            self.kv_cache.block_manager)
        self.requests: dict[RequestId, Request] = {}  # unfinished ones
        self._next_id = 0

    # -- the serving API --------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                    stop: Sequence[str] = (), request_id: RequestId | None = None,
                    arrival_time: float | None = None) -> RequestId:
        """Queue a request; returns its id. ``stop``: strings that end the request once they
        appear in its output text. ``arrival_time`` (a ``perf_counter`` stamp, default now)
        is when the request reached the server, the origin of its latencies."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {params!r}")
        try:
            # operator.index takes ints of any kind (numpy, 0-d tensors), not floats or text.
            prompt = [operator.index(t) for t in prompt_ids]
        except TypeError:
            raise InvalidRequestError("prompt_ids must be a sequence of integer token ids, got "
                                      f"{prompt_ids!r}") from None
        self.validate([prompt], params)
        if isinstance(stop, str) or not isinstance(stop, Sequence) \
                or not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError(f"stop must be a sequence of non-empty strings, got {stop!r}")
        try:
            hash(request_id)  # a dict key; isinstance(Hashable) passes a tuple holding a list
        except TypeError:
            raise InvalidRequestError(f"request_id must be hashable (a str or an int), got "
                                      f"{request_id!r}") from None
        if arrival_time is not None and (not isinstance(arrival_time, int | float)
                                         or not math.isfinite(arrival_time)):
            raise InvalidRequestError(f"arrival_time must be a perf_counter() stamp, got "
                                      f"{arrival_time!r}")
        return self._enqueue(prompt, params, tuple(stop), request_id, arrival_time)

    def step(self) -> StepResult:
        """Schedule, run one forward over every scheduled request's new tokens, sample where a
        request reached its last token, and retire the requests that stop."""
        start = time.perf_counter()
        with phase("schedule"):
            batch = self.scheduler.schedule()
        sampled: list[Request] = []
        tokens: list[int] = []
        if batch.scheduled:
            try:
                with torch.inference_mode(), attn_implementation(self.model,
                                                                 ATTN_IMPLEMENTATION):
                    sampled, tokens = self.run_batch(batch)
            except BaseException:
                # The cache may hold half a step: recompute these requests later, drop none.
                # Newest first, so the oldest ends up first in the waiting queue.
                scheduled = {request for request, _ in batch.scheduled}
                for request in reversed(list(self.scheduler.running)):
                    if request in scheduled:
                        self.scheduler.preempt(request)
                raise
        sync(self.device)  # the staging buffer is rewritten next step
        end = time.perf_counter()
        for request, n in batch.scheduled:
            request.num_computed_tokens += n
            request.timeline.steps.append((start, end))
        for request, token in zip(sampled, tokens, strict=True):
            self.append_token(request, token, end)
        num_decodes = batch.num_decodes
        manager = self.kv_cache.block_manager
        return StepResult(start, end, num_decodes, batch.num_tokens - num_decodes,
                          [r.request_id for r in batch.preempted], sampled,
                          manager.num_blocks - manager.num_free_blocks, manager.num_cached_blocks)

    def abort(self, request_id: RequestId) -> bool:
        """Drop a request and free its blocks; False if it had already finished (or never
        existed)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, FinishReason.ABORT, time.perf_counter())
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the shared Engine interface --------------------------------------------------------

    def validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        super().validate(prompts, params)
        # A request must fit the pool on its own, or no preemption could ever make room for it.
        # Its last sampled token is never fed, so it needs a slot for one token fewer.
        manager = self.kv_cache.block_manager
        for i, prompt in enumerate(prompts):
            need = blocks_for(len(prompt) + params.max_new_tokens - 1, manager.block_size)
            if need > manager.num_blocks:
                raise InvalidRequestError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens="
                    f"{params.max_new_tokens} it needs {need} KV blocks, more than the whole "
                    f"pool of {manager.num_blocks}")

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        """All prompts arrive at once; one stamp per step that produced tokens."""
        if self.requests:
            raise MiniInferError(f"generate needs an idle engine; {len(self.requests)} requests "
                                 f"added with add_request are still unfinished")
        start = time.perf_counter()
        ids = [self._enqueue(prompt, params) for prompt in prompts]
        finished: dict[RequestId, Request] = {}
        token_times = []
        try:
            while self.requests:
                result = self.step()
                if result.outputs:
                    token_times.append(result.end)
                finished.update((r.request_id, r) for r in result.outputs if r.finished)
        finally:
            for rid in ids:  # interrupted: nothing stays queued or holds blocks
                self.abort(rid)
        return GenerationResult([finished[rid].output_ids for rid in ids], start, token_times,
                                time.perf_counter())

    # -- one step ---------------------------------------------------------------------------

    def _enqueue(self, prompt: list[int], params: SamplingParams, stop: tuple[str, ...] = (),
                 request_id: RequestId | None = None,
                 arrival_time: float | None = None) -> RequestId:
        if request_id is None:
            while self._next_id in self.requests:
                self._next_id += 1
            request_id = self._next_id
            self._next_id += 1
        elif request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        request = Request(request_id, prompt, params, RequestTimeline(arrival), stop,
                          make_generator(params, self.device))
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def run_batch(self, batch: ScheduledBatch) -> tuple[list[Request], list[int]]:
        """The forward of one step; returns the requests that sample and their tokens."""
        with phase("prepare_inputs"):
            inputs, metadata, logits_rows, sampled = self.prepare_batch(batch)
        with phase("model_forward"):
            logits = self.model_forward(inputs, metadata, logits_to_keep=logits_rows)
        with phase("sample"):
            return sampled, sample_next_tokens(logits, sampled)

    def prepare_batch(self, batch: ScheduledBatch) -> tuple[
            dict[str, torch.Tensor], MixedBatchMetadata, torch.Tensor, list[Request]]:
        """Flatten the scheduled tokens (decodes first) and send their ids, positions, slots,
        context lens, chunk boundaries, logits rows and block tables in one staged copy."""
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
            if end == request.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampled.append(request)
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
        inputs = {"input_ids": ids_t[None], "position_ids": positions_t[None]}
        return inputs, MixedBatchMetadata(num_decodes, decodes, chunks), rows_t, sampled

    def append_token(self, request: Request, token: int, now: float) -> None:
        request.output_ids.append(token)
        request.timeline.token_times.append(now)
        reason = self.stop_reason(request, token)
        if reason is not None:
            del self.requests[request.request_id]
            self.scheduler.finish(request, reason, now)

    def stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if token == self.lm.eos_token_id and not params.ignore_eos:
            return FinishReason.EOS
        # A stop string ends in the newest token: earlier text held none, or we had stopped. So
        # only the tail is decoded (decoding the whole output at every token is quadratic): a
        # string of n characters is at most 4n UTF-8 bytes, every token at least one byte, so
        # it lies in the last 4n + 1 tokens (a token may start mid-character); one more keeps
        # it off the window's first token, whose leading space a decoder may drop.
        if request.stop:
            window = 4 * max(len(s) for s in request.stop) + 2
            text = self.lm.tokenizer.decode(request.output_ids[-window:])
            if any(s in text for s in request.stop):
                return FinishReason.STOP
        if len(request.output_ids) >= params.max_new_tokens:
            return FinishReason.LENGTH
        return None
