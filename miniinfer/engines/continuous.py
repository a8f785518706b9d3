"""Stage ``continuous``: continuous batching with chunked prefill and preemption.

Every stage so far ran one static batch: prefill all prompts, decode in lockstep until the
longest request is done. Here requests come and go at every step: the scheduler decides
(:mod:`miniinfer.core.scheduler`), the model runner runs (:mod:`miniinfer.runner`: the weights,
the KV pool, the forward), and this engine loops:

- ``add_request`` queues a request (its own sampling parameters, seed and stop strings);
  ``step`` schedules, runs one forward and samples; ``abort`` drops a request and frees its
  blocks. ``generate`` (the interface every stage shares) is these three in a loop.
- one forward (the runner's ``execute``) holds every scheduled request's new tokens as one flat
  sequence, exactly like the
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

import torch

from ..core.config import EngineConfig
from ..core.errors import InvalidRequestError, MiniInferError
from ..core.hardware import sync
from ..core.kv_cache import (
    BlockManager,
    PagedKVCache,
    RequestId,
    blocks_for,
)
from ..core.models import LoadedModel
from ..core.prefix_cache import PrefixCacheBlockManager, PrefixCacheScheduler
from ..core.ranges import phase
from ..core.sampling import SamplingParams, make_generator, sample_batch
from ..core.scheduler import (
    FinishReason,
    Request,
    RequestTimeline,
    ScheduledBatch,
    Scheduler,
)
from ..runner import ModelRunner
from .base import Engine, GenerationResult, batch_token_times


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


def sample_next_tokens(logits: torch.Tensor, requests: list[Request],
                       eos_token_id: int | None) -> list[int]:
    """One token per row of ``logits`` [k, V], each request with its own parameters and
    generator, in one batched sampler pass; logprobs, where asked for, go on the request."""
    sampled = sample_batch(logits, requests, eos_token_id)
    for request, logprobs in zip(requests, sampled.logprobs, strict=True):
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
            request.cumulative_logprob += logprobs.logprob
    return sampled.token_ids


def _token_id(value: object) -> int:
    """``value`` as a token id: ints of any kind (numpy, 0-d tensors; what ``operator.index``
    takes), not floats or text, and not a bool, which is an int to Python but never a token
    id. Raises ``TypeError``."""
    if isinstance(value, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(value)


class ContinuousEngine(Engine):
    """The scheduler decides, the runner runs (:class:`~miniinfer.runner.ModelRunner`: the
    weights, the KV pool and the forward), this engine loops. Everything else is a setting of
    its :class:`~miniinfer.core.config.EngineConfig`: a later stage of the book is this class
    with a ``preset`` of settings (``compiled`` is ``forward="compiled"``), and any setting
    composes with any preset (``make_engine("compiled", lm, prefix_caching=True)``), or is
    refused when the config is made. ``runner`` passes one built elsewhere (anything with
    ``kv_cache``, ``execute``, ``paged_attention`` and ``close``)."""

    name = "continuous"
    summary = "continuous batching: token-budget scheduler, chunked prefill, preemption"
    preset: dict[str, object] = {}  # the settings this stage stands for
    variants = ()  # forward= is the runner's choice; no named variants
    sampling_extras = True

    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None, *,
                 runner: ModelRunner | None = None, **options) -> None:
        """``config`` and ``options`` (any :class:`EngineConfig` field) say how it runs; the
        stage's ``preset`` applies first, ``options`` last."""
        super().__init__(lm)
        self.config = config = EngineConfig.of(
            config, **{**self.preset, **self.device_settings(lm.device), **options})
        # Chapter 09: a block manager that remembers prefixes, a scheduler that admits past them.
        manager, scheduler = ((PrefixCacheBlockManager, PrefixCacheScheduler)
                              if config.prefix_caching else (BlockManager, Scheduler))
        # A runner passed in is used as it is (its pool, its forward); else one is built here.
        self.runner = runner or ModelRunner.of(lm, config, manager)
        self.scheduler = scheduler(config.scheduler, self.kv_cache.block_manager)
        self.requests: dict[RequestId, Request] = {}  # unfinished ones
        self._next_id = 0

    @classmethod
    def device_settings(cls, device: torch.device) -> dict[str, object]:
        """Settings the stage takes on ``device`` over its preset (none: the preset holds
        everywhere); options given by name still win."""
        return {}

    @property
    def weight_bytes(self) -> int | None:
        """What a decode step reads of quantized weights (None: the model's own)."""
        return self.runner.weight_bytes

    @property
    def kv_cache(self) -> PagedKVCache:
        """The runner's pool (the scheduler books its blocks)."""
        return self.runner.kv_cache

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
            prompt = [_token_id(t) for t in prompt_ids]
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
            batch = self.schedule()
        kept: list[tuple[Request, list[int]]] = []
        if batch.scheduled:
            try:
                with torch.inference_mode(), self.runner.paged_attention():
                    logits, rows = self.runner.execute(
                        batch.plan(self.kv_cache.block_manager))
                    rows = [batch.scheduled[row][0] for row in rows]
                    with phase("sample"):
                        kept = self.sample(logits, rows)
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
        for request, tokens in kept:
            self.commit(request, tokens, end)
        num_decodes = batch.num_decodes
        manager = self.kv_cache.block_manager
        return StepResult(start, end, num_decodes, batch.num_tokens - num_decodes,
                          [r.request_id for r in batch.preempted], [r for r, _ in kept],
                          manager.num_blocks - manager.num_free_blocks, manager.num_cached_blocks)

    def abort(self, request_id: RequestId) -> bool:
        """Drop a request and free its blocks; False if it had already finished (or never
        existed)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, FinishReason.ABORT, time.perf_counter())
        return True

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks no request holds (blocks in use keep their hashes); with
        prefix caching off there is nothing to forget."""
        if self.config.prefix_caching:
            self.kv_cache.block_manager.evict_all()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Let go of what the runner started (a tensor-parallel runner's worker processes)."""
        self.runner.close()

    # -- the shared Engine interface --------------------------------------------------------

    def validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        super().validate(prompts, params)
        params.check_vocab(self.lm.config.vocab_size)
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
        """All prompts arrive at once; the batch's stamps from its requests' own."""
        if self.requests:
            raise MiniInferError(f"generate needs an idle engine; {len(self.requests)} requests "
                                 f"added with add_request are still unfinished")
        start = time.perf_counter()
        ids = [self._enqueue(prompt, params) for prompt in prompts]
        finished: dict[RequestId, Request] = {}
        try:
            while self.requests:
                result = self.step()
                finished.update((r.request_id, r) for r in result.outputs if r.finished)
        finally:
            for rid in ids:  # interrupted: nothing stays queued or holds blocks
                self.abort(rid)
        requests = [finished[rid] for rid in ids]
        return GenerationResult([r.output_ids for r in requests], start,
                                batch_token_times(r.timeline.token_times for r in requests),
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

    def schedule(self) -> ScheduledBatch:
        """Who runs in this step, and how much (the scheduler's decision)."""
        return self.scheduler.schedule()

    def sample(self, logits: torch.Tensor, rows: list[Request]) -> list[tuple[Request, list[int]]]:
        """The new tokens of each request the step scored: one row each, one token each."""
        tokens = sample_next_tokens(logits, rows, self.lm.eos_token_id)
        return [(request, [token]) for request, token in zip(rows, tokens, strict=True)]

    def commit(self, request: Request, tokens: list[int], now: float) -> None:
        """Append a request's new tokens in order, until one of them finishes it."""
        for token in tokens:
            if request.finished:
                break
            self.append_token(request, token, now)

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
        if token in params.stop_token_ids:
            return FinishReason.STOP
        # A stop string ends in the newest token: earlier text held none, or we had stopped. So
        # only the tail is decoded (decoding the whole output at every token is quadratic): a
        # string of n characters is at most 4n UTF-8 bytes, every token at least one byte, so
        # it lies in the last 4n + 1 tokens (a token may start mid-character); one more keeps
        # it off the window's first token, whose leading space a decoder may drop.
        if request.stop and len(request.output_ids) >= params.min_tokens:
            window = 4 * max(len(s) for s in request.stop) + 2
            text = self.lm.tokenizer.decode(request.output_ids[-window:])
            if any(s in text for s in request.stop):
                return FinishReason.STOP
        if len(request.output_ids) >= params.max_new_tokens:
            return FinishReason.LENGTH
        return None
