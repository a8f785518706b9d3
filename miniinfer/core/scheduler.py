"""The scheduler of continuous batching (chapter 08): who runs in the next step, and how much.

Static batching runs a fixed group of requests from the first prefill to the last token of the
longest one; a request that finishes early leaves its row idle, and a request that arrives
meanwhile waits for the whole batch. Continuous batching decides again at every step:

- a *waiting* queue (arrived, holding no KV blocks) and a *running* list (holding blocks);
- every step has a token budget, ``max_num_batched_tokens``: the running requests are served
  first, oldest first (a decode costs one token), then waiting requests are admitted in arrival
  order while the budget, the free KV blocks and ``max_num_seqs`` allow;
- a prompt longer than what is left of the budget is split into chunks over several steps
  (chunked prefill, or Dynamic SplitFuse), so the decodes that share its steps keep a short,
  steady step time instead of stalling behind a whole long prompt;
- a request that finishes gives its blocks back at once, so a waiting one can start next step;
- when a running request needs a block and none is free, the newest running request is
  *preempted*: its blocks are freed, it goes back to the front of the waiting queue with the
  tokens it has generated so far, and when it runs again those are recomputed as a prefill
  (recomputation, as vLLM does by default). Nothing is ever dropped.

A request's tokens are its prompt followed by its output so far; ``num_computed_tokens`` of them
have their K/V in the cache. A step feeds the next uncomputed ones, so a decode, a prompt chunk
and the recomputation after a preemption are one and the same thing: a request whose step
reaches its last token gets a new token sampled from that position.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from .errors import InvalidRequestError, KVCacheFull
from .kv_cache import BlockManager, RequestId
from .sampling import PenaltyState, SamplingParams, TokenLogprobs


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(Enum):
    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"
    STOP = "stop"  # a stop string appeared in the output text
    ABORT = "abort"


@dataclass(slots=True)
class RequestTimeline:
    """When things happened to one request, all ``time.perf_counter()`` stamps.

    ``steps`` holds the (start, end) of every step the request was part of, prefill chunks and
    recomputation included; ``token_times`` the end of the step that produced each output token
    (the token is on the host then). The serving metrics (:mod:`miniinfer.bench.serving`) are all
    computed from these.
    """

    arrival: float
    first_scheduled: float | None = None
    steps: list[tuple[float, float]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None


@dataclass(slots=True, eq=False)
class Request:
    """One request as the scheduler and the engine see it."""

    request_id: RequestId
    prompt_ids: list[int]
    params: SamplingParams
    timeline: RequestTimeline
    stop: tuple[str, ...] = ()
    generator: torch.Generator | None = None  # its own, so a seed gives the same tokens in any batch
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (ch. 09)
    # The sampler's per-request state (sampling.sample_batch): one entry per output token when
    # params.logprobs is set, their running sum (best_of ranks by it), and the penalties' counts.
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    penalty_state: PenaltyState | None = None
    # Tokens proposed for this step beyond the request's own (chapter 14's speculative step):
    # fed after its last token and verified in the same forward; never part of num_tokens.
    draft_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Its committed tokens: prompt and output (drafts are not counted)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output (+ drafts, past ``num_tokens``), without
        building the concatenation."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        ids = self.prompt_ids[start:] + self.output_ids[max(start - n, 0) : end - n]
        if end > self.num_tokens:
            ids += self.draft_ids[max(start - self.num_tokens, 0) : end - self.num_tokens]
        return ids


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """``max_num_batched_tokens``: the token budget of one step (prompt chunks plus decodes);
    ``max_num_seqs``: at most this many running requests; ``chunked_prefill=False`` schedules a
    prompt whole, and one longer than the budget only when it runs alone."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(slots=True)
class ScheduledBatch:
    """What one step runs: ``(request, number of its tokens to feed)``, decodes (one token)
    first and prompt chunks after them, plus the requests preempted to make room."""

    scheduled: list[tuple[Request, int]]
    preempted: list[Request]
    # How many of a request's fed positions (its last ones) get logits, where not the default
    # (one when the step reaches the request's last token, else none). A speculative step
    # feeds a request's last token and k draft tokens and scores all k + 1 (chapter 14).
    num_scored: dict[RequestId, int] = field(default_factory=dict)

    @property
    def num_decodes(self) -> int:
        """Requests fed one token (a decode, or a one-token prompt chunk; the scheduler puts
        them first): they go through the decode kernel, the others (prompt chunks, a
        speculative step's k + 1 tokens) through the varlen one."""
        return sum(n == 1 for _, n in self.scheduled)

    def scored(self, request: Request, n: int) -> int:
        """How many of the ``n`` positions ``request`` is fed in this step get logits."""
        scored = self.num_scored.get(request.request_id)
        if scored is None:
            return int(request.num_computed_tokens + n == request.num_tokens)
        if not 0 <= scored <= n:
            raise InvalidRequestError(f"request {request.request_id!r} is fed {n} token(s) "
                                      f"this step; cannot score {scored}")
        return scored

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def plan(self, block_manager: BlockManager) -> StepPlan:
        """This step as plain data for the runner: what each request feeds, where, into which
        blocks, and how many of its positions are scored; no live request goes with it."""
        return StepPlan([
            ScheduledRequest(request.request_id,
                             request.token_ids(request.num_computed_tokens,
                                               request.num_computed_tokens + n),
                             request.num_computed_tokens,
                             list(block_manager.block_tables[request.request_id]),
                             self.scored(request, n))
            for request, n in self.scheduled])


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's part of a step (vLLM's ``SchedulerOutput`` holds the same per request id):
    the token ids it feeds (a decode's one, a prompt chunk, or a last token and its drafts),
    the position of the first, its block table, and how many of its last positions get
    logits."""

    request_id: RequestId
    token_ids: list[int]
    start: int
    block_table: list[int]
    num_scored: int

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A scheduled step as the runner reads it: requests fed one token first (decodes), then
    the others (prompt chunks, verification steps), as the scheduler ordered them."""

    requests: list[ScheduledRequest]

    @property
    def num_decodes(self) -> int:
        return sum(len(r.token_ids) == 1 for r in self.requests)


class Scheduler:
    """Waiting queue, running list and the per-step decision. Blocks come from ``block_manager``,
    which tracks for each running request how many of its tokens have a KV slot."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        now = time.perf_counter()
        # Running requests first: an admitted request is never starved by new prompts.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_new_tokens(request, budget, alone=not scheduled)
            if n == 0:  # an unchunked prompt that does not fit what is left of the budget
                i += 1
                continue
            while not self._try_take(request, n, admit=False):
                if request.draft_ids:  # drafts are the first thing to give up, not a request
                    n -= len(request.draft_ids)
                    request.draft_ids.clear()
                    continue
                # Only requests after i can be victims (the newest is last), so every request
                # already scheduled this step keeps its blocks.
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                scheduled.append((request, n))
                budget -= n
            i += 1
        # New requests only when nobody had to give blocks back: admitting one now would take
        # the blocks a preempted request is waiting for.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            n = self._admit(request, budget, alone=not scheduled)
            if n == 0:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.timeline.first_scheduled is None:
                request.timeline.first_scheduled = now
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n
        # The forward runs decodes through the decode kernel and chunks through the varlen one.
        scheduled.sort(key=lambda item: item[1] != 1)
        # A request fed drafts is scored at its last token and at every draft (chapter 14).
        num_scored = {r.request_id: len(r.draft_ids) + 1 for r, _ in scheduled if r.draft_ids}
        return ScheduledBatch(scheduled, preempted, num_scored)

    def _admit(self, request: Request, budget: int, alone: bool) -> int:
        """Blocks for a waiting request's first tokens; how many it feeds this step (0: it does
        not fit, and holds nothing)."""
        n = self._num_new_tokens(request, budget, alone)
        if n == 0 or not self._try_take(request, n, admit=True):
            return 0
        return n

    def _num_new_tokens(self, request: Request, budget: int, alone: bool) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if request.draft_ids:  # a speculative step: its drafts too, as many as the budget takes
            del request.draft_ids[max(budget - remaining, 0):]
            remaining += len(request.draft_ids)
        if remaining <= budget or (alone and not self.config.chunked_prefill):
            return remaining
        return budget if self.config.chunked_prefill else 0

    def _try_take(self, request: Request, n: int, admit: bool) -> bool:
        """KV slots for ``n`` more tokens of ``request``; False (and nothing taken) if the pool
        is out of blocks."""
        try:
            if admit:
                self.block_manager.add(request.request_id, n)
            else:
                self.block_manager.append(request.request_id, n)
        except KVCacheFull:
            return False
        return True

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it at the front of the waiting queue; it will
        recompute its prompt and output so far when it runs again."""
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.draft_ids.clear()
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def set_aside(self) -> list[Request]:
        """Preempt every running request and empty the waiting queue -> every unfinished
        request, oldest first, none scheduled until :meth:`put_back` (a server isolating a
        failing request runs suspects alone in between)."""
        for request in reversed(list(self.running)):  # the oldest ends up first
            self.preempt(request)
        requests = list(self.waiting)
        self.waiting.clear()
        return requests

    def take_out(self, request: Request) -> None:
        """A request out of the queues (preempted first if running), until :meth:`put_back`."""
        if request.status is RequestStatus.RUNNING:
            self.preempt(request)
        self.waiting.remove(request)

    def put_back(self, requests: list[Request]) -> None:
        """Requests set aside or taken out wait again, in this order, after those waiting."""
        self.waiting.extend(requests)

    def finish(self, request: Request, reason: FinishReason, now: float) -> None:
        """Take a request out of its queue; a running one gives its blocks back at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.block_manager.free(request.request_id)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.timeline.finish = now
