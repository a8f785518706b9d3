"""Ways to serve a workload (chapter 08): ``continuous`` (our chapter 08 engine, and
``prefix-cache``, chapter 09's engine built on it),
``static-<engine>`` (request-level batching with any earlier stage: when the engine is free it
takes up to ``static_batch_size`` requests that have arrived and runs them to the end of the
longest) and ``hf-cb`` (transformers' own continuous batching, the manager behind
``model.generate_batch``).

Arrivals are replayed in real time: a request that arrives while a step runs waits for it, and
that wait is part of its latency. EOS is ignored so every system generates exactly the requested
number of tokens.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from ...core.errors import UnknownNameError
from ...core.kv_cache import DEFAULT_BLOCK_SIZE, KVCacheConfig
from ...core.models import LoadedModel
from ...core.sampling import SamplingParams
from ...core.scheduler import RequestTimeline
from ...engines import ENGINES, Engine, make_engine
from ...engines.continuous import ContinuousEngine, StepResult
from ...engines.prefix_cache import PrefixCacheEngine
from ..devices import kv_bytes_per_token
from ..peers import VLLM, check_peer
from .workloads import WorkloadRequest

STATIC_PREFIX = "static-"
# transformers' default KV block for its continuous batching; at 16 tokens its CPU path is
# several times slower, so it gets its own default (and the same KV memory as ours).
HF_CB_BLOCK_SIZE = 256
# vLLM's default cap on the requests it runs at once (LLM and `vllm serve`, CPU build too).
VLLM_MAX_NUM_SEQS = 256
# Our engines that serve request by request (``add_request``/``step``), with a token budget.
# Systems stepped by our scheduler: every stage built on chapter 08's engine.
STEPPED_SYSTEMS = tuple(name for name, cls in ENGINES.items() if issubclass(cls, ContinuousEngine))


@dataclass(slots=True)
class ServedRequest:
    index: int
    prompt_len: int
    output_ids: list[int]
    timeline: RequestTimeline
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from a prefix cache; None: unknown


@dataclass(slots=True)
class ServingRun:
    """One system serving one workload: per-request timelines, and the steps of our engine."""

    system: str
    start: float
    requests: list[ServedRequest]
    steps: list[StepResult] = field(default_factory=list)
    peer_version: str = ""  # which build of a peer served it ("": one of ours)

    @property
    def end(self) -> float:
        return max(r.timeline.finish for r in self.requests)


def _wait_until(t: float) -> None:
    # In short sleeps: Ctrl-C reaches this (worker) thread as an exception raised between
    # bytecodes (see the benchmark), never in the middle of one long sleep.
    while (left := t - time.perf_counter()) > 0:
        time.sleep(min(left, 0.1))


def _ignore_eos(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def serve_continuous(engine: ContinuousEngine, workload: Sequence[WorkloadRequest]) -> ServingRun:
    pending = deque(sorted(workload, key=lambda w: w.arrival_s))
    run = ServingRun(engine.name, time.perf_counter(), [])
    by_id = {w.index: w for w in workload}
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            _wait_until(run.start + pending[0].arrival_s)
        now = time.perf_counter()
        while pending and run.start + pending[0].arrival_s <= now:
            w = pending.popleft()
            engine.add_request(w.prompt_ids, _ignore_eos(w.max_new_tokens), request_id=w.index,
                               arrival_time=run.start + w.arrival_s)
        step = engine.step()
        run.steps.append(step)
        run.requests += [ServedRequest(r.request_id, len(by_id[r.request_id].prompt_ids),
                                       r.output_ids, r.timeline, r.num_preemptions,
                                       r.num_cached_tokens)
                         for r in step.outputs if r.finished]
    run.requests.sort(key=lambda r: r.index)
    return run


def serve_static(engine: Engine, workload: Sequence[WorkloadRequest],
                 batch_size: int = 8) -> ServingRun:
    """Request-level batching: each batch runs to its longest request. A request's tokens are
    stamped as its batch produces them (as if streamed), so only the waiting is charged."""
    pending = deque(sorted(workload, key=lambda w: w.arrival_s))
    run = ServingRun(f"{STATIC_PREFIX}{engine.name}", time.perf_counter(), [])
    while pending:
        _wait_until(run.start + pending[0].arrival_s)
        now = time.perf_counter()
        batch = []
        while pending and len(batch) < batch_size and run.start + pending[0].arrival_s <= now:
            batch.append(pending.popleft())
        result = engine.generate([w.prompt_ids for w in batch],
                                 _ignore_eos(max(w.max_new_tokens for w in batch)))
        for w, ids in zip(batch, result.token_ids, strict=True):
            times = result.token_times[: w.max_new_tokens]
            run.requests.append(ServedRequest(
                w.index, len(w.prompt_ids), ids[: w.max_new_tokens],
                RequestTimeline(run.start + w.arrival_s, result.start, [], times, times[-1])))
    run.requests.sort(key=lambda r: r.index)
    return run


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' continuous batching logs through its own handler; keep it to errors."""
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    level = cb_logger.level
    cb_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        cb_logger.setLevel(level)


def serve_hf_cb(lm: LoadedModel, workload: Sequence[WorkloadRequest], max_batch_tokens: int,
                kv_cache_bytes: int, block_size: int = HF_CB_BLOCK_SIZE) -> ServingRun:
    """transformers' continuous batching: the manager ``model.generate_batch`` wraps, used
    directly so that each request keeps its own output length and arrival time. It schedules
    with the same token budget and gets as many KV bytes as our engine."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    num_blocks = max(1, kv_cache_bytes // (kv_bytes_per_token(lm) * block_size))
    generation_config = GenerationConfig(
        max_new_tokens=max(w.max_new_tokens for w in workload), do_sample=False,
        eos_token_id=-1,  # transformers' spelling of "ignore EOS"
        pad_token_id=lm.pad_token_id)
    cb_config = ContinuousBatchingConfig(block_size=block_size, num_blocks=num_blocks,
                                         max_batch_tokens=max_batch_tokens)
    pending = sorted(workload, key=lambda w: w.arrival_s)
    outputs = {}
    # warmup=True builds the cache before the clock starts (on a CPU there is nothing to
    # capture); the generation loop runs in transformers' background thread.
    with _quiet_transformers(), lm.model.continuous_batching_context_manager(
            generation_config=generation_config, continuous_batching_config=cb_config,
            block=True, warmup=True) as manager:
        start = time.perf_counter()
        for w in pending:
            _wait_until(start + w.arrival_s)
            manager.add_request(w.prompt_ids, request_id=str(w.index),
                                max_new_tokens=w.max_new_tokens, record_timestamps=True)
        while len(outputs) < len(pending):
            output = manager.get_result(timeout=1)
            if output is not None and output.is_finished():
                if output.error is not None:
                    raise RuntimeError(f"transformers continuous batching failed request "
                                       f"{output.request_id}: {output.error}")
                outputs[int(output.request_id)] = output
            elif output is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
    return ServingRun("hf-cb", start, [
        ServedRequest(w.index, len(w.prompt_ids), outputs[w.index].generated_tokens,
                      RequestTimeline(start + w.arrival_s, outputs[w.index].lifespan[0], [],
                                      outputs[w.index].timestamps, outputs[w.index].lifespan[1]))
        for w in sorted(workload, key=lambda w: w.index)])


def check_system(system: str) -> None:
    if system == VLLM:  # the peer, from its own venv: found, or one line on how to install it
        check_peer(system)
        return
    engine = system.removeprefix(STATIC_PREFIX)
    if system.startswith(STATIC_PREFIX) and engine in ENGINES and engine not in STEPPED_SYSTEMS:
        return
    if system not in (*STEPPED_SYSTEMS, "hf-cb"):
        static = ", ".join(STATIC_PREFIX + e for e in ENGINES if e not in STEPPED_SYSTEMS)
        raise UnknownNameError(f"unknown serving system {system!r}; systems: "
                               f"{', '.join(STEPPED_SYSTEMS)}, hf-cb, {VLLM}, {static}")


def default_pool_bytes(lm: LoadedModel) -> int:
    """The KV pool an engine gets by default (see ``KVCacheConfig``), without allocating it."""
    block_bytes = kv_bytes_per_token(lm) * DEFAULT_BLOCK_SIZE
    return KVCacheConfig().resolve_num_blocks(block_bytes, lm.max_context) * block_bytes


def serve_vllm(engine: Engine, workload: Sequence[WorkloadRequest]) -> ServingRun:
    """Chapter 08's workload through vLLM: every request added at its arrival (all at once for
    the offline case, as ``LLM.generate`` does), greedy, EOS ignored; ``engine`` is the peer's
    ``VLLMEngine``. "Scheduled" is when the
    driver handed the request to vLLM's engine (vLLM's own scheduling time is not reported)."""
    start = time.perf_counter()
    (run,) = engine.run([{"prompt_ids": w.prompt_ids, "max_tokens": w.max_new_tokens,
                          "arrival_s": w.arrival_s} for w in workload],
                        SamplingParams(ignore_eos=True))
    served = []
    for w, r in zip(workload, run["requests"], strict=True):
        times = [start + t for t in r["token_times_s"]]
        served.append(ServedRequest(w.index, len(w.prompt_ids), r["token_ids"], RequestTimeline(
            start + w.arrival_s, start + r["scheduled_s"], [], times, times[-1])))
    return ServingRun(VLLM, start, sorted(served, key=lambda r: r.index),
                      peer_version=engine.version)


class Systems:
    """Serves workloads with one system at a time. Its engine (and the KV pool allocated with
    it) is kept while the next runs use the same system and budget, then let go; with
    ``keep_engines`` every engine is kept until :meth:`close`, for runs that come back to it."""

    def __init__(self, lm: LoadedModel, kv_cache_bytes: int | None = None,
                 static_batch_size: int = 8, tensor_parallel: int | None = None,
                 keep_engines: bool = False) -> None:
        self.lm = lm
        self.kv_cache_bytes = kv_cache_bytes or default_pool_bytes(lm)
        self.static_batch_size = static_batch_size
        # None: each stepped system's own default (1, or the tensor-parallel stage's 2).
        self.runner_options = {} if tensor_parallel is None else \
            {"tensor_parallel": tensor_parallel}
        self.keep_engines = keep_engines
        self.engines: dict[tuple[str, int], Engine] = {}

    def close(self) -> None:
        """Let go of every engine kept (and what their runners started)."""
        for engine in self.engines.values():
            if hasattr(engine, "close"):
                engine.close()
        self.engines.clear()

    def serve(self, system: str, budget: int, workload: list[WorkloadRequest]) -> ServingRun:
        if system == "hf-cb":
            return serve_hf_cb(self.lm, workload, budget, self.kv_cache_bytes)
        key = (system, budget)
        if key not in self.engines:
            if not self.keep_engines:
                self.close()  # the old pool goes before the new one is allocated
            self.engines[key] = self._build(system, budget)
        engine = self.engines[key]
        if system == VLLM:
            return serve_vllm(engine, workload)
        if isinstance(engine, PrefixCacheEngine):
            engine.reset_prefix_cache()  # every run starts cold, the warm-up's blocks forgotten
        if isinstance(engine, ContinuousEngine):
            return serve_continuous(engine, workload)
        return serve_static(engine, workload, self.static_batch_size)

    def _build(self, system: str, budget: int) -> Engine:
        if system == VLLM:
            from ..peers.vllm_peer import VLLMEngine

            # The same token budget, and at least our pool's KV memory (vLLM takes GiB).
            # Under a budget of fewer tokens than vLLM's default number of running
            # requests vLLM refuses to start; ours can run no more requests than the
            # budget has tokens (a decode costs one), so that is vLLM's cap there too.
            return VLLMEngine(self.lm, max_num_batched_tokens=budget,
                              max_num_seqs=budget if budget < VLLM_MAX_NUM_SEQS else None,
                              kv_cache_gib=max(1, math.ceil(self.kv_cache_bytes / 2**30)))
        if system in STEPPED_SYSTEMS:
            return make_engine(system, self.lm, max_num_batched_tokens=budget,
                               kv_cache_bytes=self.kv_cache_bytes, **self.runner_options)
        return make_engine(system.removeprefix(STATIC_PREFIX), self.lm)
