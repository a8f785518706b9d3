"""Online serving benchmark (chapter 08): a workload that arrives over time, three ways to serve
it, and the metrics serving systems are judged by.

- **Workload**: ``num_requests`` requests with Poisson arrivals at ``request_rate`` per second
  (``inf``: all at once, the offline case), prompt and output lengths drawn uniformly from
  ranges, or prompts (and output lengths) sampled from a JSONL dataset file. Seeded: the same
  config gives the same requests, token for token, to every system.
- **Systems**: ``continuous`` (our chapter 08 engine), ``static-<engine>`` (request-level
  batching with any earlier stage: when the engine is free it takes up to ``static_batch_size``
  requests that have arrived and runs them to the end of the longest) and ``hf-cb``
  (transformers' own continuous batching, the manager behind ``model.generate_batch``).
  Arrivals are replayed in real time: a request that arrives while a step runs waits for it,
  and that wait is part of its latency. EOS is ignored so every system generates exactly the
  requested number of tokens.
- **Metrics**, the usual definitions (vLLM's ``benchmark_serving``): TTFT = first token -
  arrival; end-to-end latency = last token - arrival; TPOT = (latency - TTFT) / (output tokens -
  1), per request; ITL = the gaps between a request's consecutive tokens, pooled over requests;
  request and output-token throughput over the run's duration (start to the last finish). Each
  latency is reported as mean, p50, p90 and p99.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from .bench import FIRST_PLAIN_TOKEN
from .devices import kv_bytes_per_token, run_metadata
from .engines import ENGINES, Engine, make_engine
from .engines.continuous import ContinuousEngine, StepResult
from .errors import InvalidRequestError, UnknownNameError
from .inputs import read_jsonl
from .kv_cache import DEFAULT_BLOCK_SIZE, KVCacheConfig
from .models import LoadedModel
from .sampling import SamplingParams
from .scheduler import RequestTimeline

STATIC_PREFIX = "static-"
# transformers' default KV block for its continuous batching; at 16 tokens its CPU path is
# several times slower, so it gets its own default (and the same KV memory as ours).
HF_CB_BLOCK_SIZE = 256
LATENCIES = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """``prompt_len`` and ``output_len`` are inclusive ranges; with a ``dataset`` the prompts
    come from the file, and so do output lengths where a line gives one."""

    num_requests: int = 32
    request_rate: float = math.inf
    prompt_len: tuple[int, int] = (16, 256)
    output_len: tuple[int, int] = (32, 128)
    dataset: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise InvalidRequestError(f"num_requests must be >= 1, got {self.num_requests!r}")
        if not self.request_rate > 0:
            raise InvalidRequestError(f"request_rate must be > 0 (inf: all at once), got "
                                      f"{self.request_rate!r}")
        if self.dataset is not None and not Path(self.dataset).is_file():
            raise InvalidRequestError(f"dataset file {self.dataset} does not exist")
        for name in ("prompt_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise InvalidRequestError(f"{name} must be a range 1 <= low <= high, got "
                                          f"{low}-{high}")


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    index: int
    arrival_s: float  # after the start of the run
    prompt_ids: list[int]
    max_new_tokens: int


def read_dataset(path: str | Path, tokenizer) -> list[tuple[list[int], int | None]]:
    """A JSONL file, one ``{"prompt": text, "output_len": n}`` per line (``output_len``
    optional): the tokenized prompts and their output lengths."""
    path = Path(path)
    items = []
    for n, item in read_jsonl(path):
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) \
                or not item["prompt"].strip():
            raise InvalidRequestError(f'{path}:{n} needs a non-empty string "prompt"')
        output_len = item.get("output_len")
        if output_len is not None and (not isinstance(output_len, int) or output_len < 1):
            raise InvalidRequestError(f'{path}:{n}: "output_len" must be an integer >= 1')
        items.append((tokenizer.encode(item["prompt"]), output_len))
    if not items:
        raise InvalidRequestError(f"dataset file {path} holds no prompts")
    return items


def make_workload(lm: LoadedModel, config: WorkloadConfig) -> list[WorkloadRequest]:
    rng = random.Random(config.seed)
    dataset = read_dataset(config.dataset, lm.tokenizer) if config.dataset else None
    arrival = 0.0
    requests = []
    for index in range(config.num_requests):
        if index and math.isfinite(config.request_rate):
            # Poisson arrivals: exponential gaps with mean 1 / rate.
            arrival += rng.expovariate(config.request_rate)
        output_len = rng.randint(*config.output_len)
        if dataset:
            prompt, given = rng.choice(dataset)
            output_len = given or output_len
        else:
            prompt = [rng.randrange(FIRST_PLAIN_TOKEN, lm.config.vocab_size)
                      for _ in range(rng.randint(*config.prompt_len))]
        requests.append(WorkloadRequest(index, arrival, list(prompt), output_len))
    return requests


@dataclass(slots=True)
class ServedRequest:
    index: int
    prompt_len: int
    output_ids: list[int]
    timeline: RequestTimeline
    num_preemptions: int = 0


@dataclass(slots=True)
class ServingRun:
    """One system serving one workload: per-request timelines, and the steps of our engine."""

    system: str
    start: float
    requests: list[ServedRequest]
    steps: list[StepResult] = field(default_factory=list)

    @property
    def end(self) -> float:
        return max(r.timeline.finish for r in self.requests)


def _wait_until(t: float) -> None:
    time.sleep(max(0.0, t - time.perf_counter()))


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
                                       r.output_ids, r.timeline, r.num_preemptions)
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


# -- metrics --------------------------------------------------------------------------------

def request_table(run: ServingRun) -> pd.DataFrame:
    """One row per request: its timeline relative to the run's start (s) and its latencies (ms)."""
    rows = []
    for r in run.requests:
        t = r.timeline
        n = len(t.token_times)
        e2e = t.finish - t.arrival
        ttft = t.first_token - t.arrival
        rows.append({
            "request": r.index, "prompt_len": r.prompt_len, "output_len": n,
            "arrival_s": t.arrival - run.start, "first_scheduled_s": t.first_scheduled - run.start,
            "first_token_s": t.first_token - run.start, "finish_s": t.finish - run.start,
            "queue_ms": (t.first_scheduled - t.arrival) * 1e3, "ttft_ms": ttft * 1e3,
            "tpot_ms": (e2e - ttft) / (n - 1) * 1e3 if n > 1 else math.nan,
            "e2e_ms": e2e * 1e3, "num_preemptions": r.num_preemptions,
        })
    return pd.DataFrame(rows)


def step_table(run: ServingRun) -> pd.DataFrame:
    """Our engine's steps, relative to the run's start: what each forward held."""
    return pd.DataFrame([{
        "step": i, "start_s": s.start - run.start, "end_s": s.end - run.start,
        "num_decodes": s.num_decodes, "num_prefill_tokens": s.num_prefill_tokens,
        "num_preempted": len(s.preempted),
    } for i, s in enumerate(run.steps)])


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    values = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if not len(values):
        return {f"{name}_mean_ms": math.nan, **{f"{name}_p{p}_ms": math.nan for p in PERCENTILES}}
    return {f"{name}_mean_ms": float(values.mean()),
            **{f"{name}_p{p}_ms": float(np.percentile(values, p)) for p in PERCENTILES}}


def summarize(run: ServingRun) -> dict[str, float]:
    """The run's throughputs and latency statistics (one row of the results CSV)."""
    table = request_table(run)
    itl = [(b - a) * 1e3 for r in run.requests
           for a, b in zip(r.timeline.token_times, r.timeline.token_times[1:], strict=False)]
    duration = run.end - run.start
    out = {"num_requests": len(table), "output_tokens": int(table.output_len.sum()),
           "duration_s": duration, "request_throughput": len(table) / duration,
           "output_throughput": table.output_len.sum() / duration}
    for name in LATENCIES:
        out |= _stats(name, itl if name == "itl" else table[f"{name}_ms"])
    return out


# -- the benchmark --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ServingBenchConfig:
    """Every system in ``systems`` serves the workload at every rate in ``request_rates``
    (none: the workload's own rate); ``continuous`` and ``hf-cb`` once per token budget in
    ``max_num_batched_tokens``."""

    workload: WorkloadConfig = WorkloadConfig()
    systems: tuple[str, ...] = ("continuous", "static-paged-attention", "hf-cb")
    request_rates: tuple[float, ...] = ()
    max_num_batched_tokens: tuple[int, ...] = (512,)
    static_batch_size: int = 8
    kv_cache_bytes: int | None = None  # our engine's pool and hf-cb's; None: the default pool
    warmup: bool = True
    chapter: str = "08"

    def __post_init__(self) -> None:
        if not self.systems or not self.max_num_batched_tokens:
            raise InvalidRequestError("need at least one system and one token budget")
        for system in self.systems:
            check_system(system)
        for rate in self.request_rates:
            replace(self.workload, request_rate=rate)  # validates
        if min(self.max_num_batched_tokens) < 1 or self.static_batch_size < 1:
            raise InvalidRequestError("max_num_batched_tokens and static_batch_size must be >= 1")


def check_system(system: str) -> None:
    engine = system.removeprefix(STATIC_PREFIX)
    if system.startswith(STATIC_PREFIX) and engine in ENGINES and engine != "continuous":
        return
    if system not in ("continuous", "hf-cb"):
        static = ", ".join(STATIC_PREFIX + e for e in ENGINES if e != "continuous")
        raise UnknownNameError(f"unknown serving system {system!r}; systems: continuous, "
                               f"hf-cb, {static}")


@dataclass(slots=True)
class ServingResults:
    runs: pd.DataFrame  # one row per system x rate x token budget
    requests: pd.DataFrame  # one row per request of every run
    steps: pd.DataFrame  # one row per step of every continuous run


def default_pool_bytes(lm: LoadedModel) -> int:
    """The KV pool an engine gets by default (see ``KVCacheConfig``), without allocating it."""
    block_bytes = kv_bytes_per_token(lm) * DEFAULT_BLOCK_SIZE
    return KVCacheConfig().resolve_num_blocks(block_bytes, lm.max_context) * block_bytes


class _Systems:
    """Serves workloads with one system at a time; its engine (and the KV pool allocated with
    it) is kept while the next runs use the same system and budget, then let go."""

    def __init__(self, lm: LoadedModel, config: ServingBenchConfig) -> None:
        self.lm = lm
        self.config = config
        self.kv_cache_bytes = config.kv_cache_bytes or default_pool_bytes(lm)
        self.current: tuple[tuple[str, int], Engine] | None = None

    def serve(self, system: str, budget: int, workload: list[WorkloadRequest]) -> ServingRun:
        if system == "hf-cb":
            return serve_hf_cb(self.lm, workload, budget, self.kv_cache_bytes)
        if self.current is None or self.current[0] != (system, budget):
            self.current = None  # the old pool goes before the new one is allocated
            engine = make_engine("continuous", self.lm, max_num_batched_tokens=budget,
                                 memory_bytes=self.kv_cache_bytes) if system == "continuous" \
                else make_engine(system.removeprefix(STATIC_PREFIX), self.lm)
            self.current = ((system, budget), engine)
        engine = self.current[1]
        if isinstance(engine, ContinuousEngine):
            return serve_continuous(engine, workload)
        return serve_static(engine, workload, self.config.static_batch_size)


def run_serving_bench(lm: LoadedModel, config: ServingBenchConfig,
                      progress: bool = True) -> ServingResults:
    """Every planned run after a short warm-up of its system; arrivals and lengths come from
    the same seed for every system, so each serves exactly the same requests."""
    meta = run_metadata(lm.device)
    tags = {"chapter": config.chapter, "model": lm.name,
            "dtype": str(lm.dtype).removeprefix("torch.")}
    budgets = config.max_num_batched_tokens
    rates = config.request_rates or (config.workload.request_rate,)
    plan = [(rate, system, budget) for system in config.systems
            for budget in (budgets if system in ("continuous", "hf-cb") else [0])
            for rate in rates]
    warmup = [replace(w, max_new_tokens=4) for w in make_workload(
        lm, replace(config.workload, num_requests=4, request_rate=math.inf))]
    systems = _Systems(lm, config)
    runs, requests, steps = [], [], []
    # Every system serves from a worker thread, because transformers' continuous batching
    # always runs its loop in one: on our CPU machine PyTorch's matrix multiplies run
    # differently in the main thread than in others (like one thread; faster when the cores
    # are contended, slower when they are free), and a comparison must not hinge on that.
    with ThreadPoolExecutor(max_workers=1) as worker:
        for rate, system, budget in tqdm(plan, desc="bench-serving", disable=not progress,
                                         leave=False):
            if config.warmup:
                worker.submit(systems.serve, system, budget or budgets[0], warmup).result()
            workload = make_workload(lm, replace(config.workload, request_rate=rate))
            run = worker.submit(systems.serve, system, budget or budgets[0], workload).result()
            run_tags = {**tags, "system": system, "request_rate": rate,
                        "max_num_batched_tokens": budget or math.nan}
            runs.append({**run_tags, **summarize(run)})
            requests.append(request_table(run).assign(**run_tags))
            if run.steps:
                steps.append(step_table(run).assign(**run_tags))
    w = config.workload
    workload_cols = {"num_requests_config": w.num_requests,
                     "prompt_len_range": f"{w.prompt_len[0]}-{w.prompt_len[1]}",
                     "output_len_range": f"{w.output_len[0]}-{w.output_len[1]}",
                     "dataset": Path(w.dataset).name if w.dataset else "", "seed": w.seed,
                     "static_batch_size": config.static_batch_size}
    return ServingResults(
        pd.DataFrame(runs).assign(**workload_cols, **meta),
        pd.concat(requests, ignore_index=True).assign(**meta),
        pd.concat(steps, ignore_index=True).assign(**meta) if steps else pd.DataFrame())


def summary_table(runs: pd.DataFrame) -> pd.DataFrame:
    """The compact view printed after a run."""
    cols = ["system", "request_rate", "max_num_batched_tokens", "output_throughput",
            "request_throughput", "ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms", "e2e_p50_ms"]
    return runs[cols].round(2).reset_index(drop=True)
