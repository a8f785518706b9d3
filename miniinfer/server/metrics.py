"""``GET /metrics``: the server's counters, latency histograms and gauges in Prometheus' text
format, under vLLM's names (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:prefix_cache_hits``, ``vllm:time_to_first_token_seconds``...) and its ``model_name``
label, so a dashboard built for vLLM reads our server as it is. Three gauges vLLM does not have
are ours (``miniinfer:kv_blocks_*``: the pool in blocks rather than a fraction;
``miniinfer:engine_healthy``: 0 once the engine can no longer serve).

Latencies come from each request's timeline in the engine (arrival at the server to the step
that produced the token), so they leave out the HTTP hop that a client's own measurement
includes. The prefix-cache counters count prompt tokens: ``queries`` every prompt token of an
admitted request, ``hits`` those its admission found cached (chapter 09's block manager); an
engine without a prefix cache never hits."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ..core.scheduler import FinishReason, Request
from ..engines.continuous import ContinuousEngine

# From a few ms (a GPU decode) to minutes (a long answer on a busy CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """One registry per server, so several servers in one process (tests) keep apart."""

    def __init__(self, engine: ContinuousEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        label = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r).labels(model_name)

        self._requests = Counter("vllm:request_success", "Requests that ended, by finish "
                                 "reason (stop, length, abort, error).",
                                 ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that "
                                     "ended.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted (their blocks "
                                   "freed, to be recomputed).")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up "
                                      "in the prefix cache at admission.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the "
                                   "prefix cache at admission.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.",
                              LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between two tokens of "
                             "a request.", TOKEN_GAP_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Per request: (last "
                              "token - first token) / (output tokens - 1).", TOKEN_GAP_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.",
                             LATENCY_BUCKETS)
        scheduler = engine.scheduler
        manager = engine.kv_cache.block_manager
        # Read at scrape time, from the handler's thread: a length or a number the engine
        # thread updates is a consistent snapshot under the GIL.
        gauge("vllm:num_requests_running", "Requests holding KV blocks.").set_function(
            lambda: len(scheduler.running))
        gauge("vllm:num_requests_waiting", "Requests queued for admission.").set_function(
            lambda: len(scheduler.waiting))
        in_use = lambda: manager.num_blocks - manager.num_free_blocks  # noqa: E731
        gauge("vllm:kv_cache_usage_perc", "Share of the KV cache's blocks held by requests "
              "(0 to 1).").set_function(lambda: in_use() / manager.num_blocks)
        gauge("miniinfer:kv_blocks_in_use", "KV cache blocks held by requests.").set_function(
            in_use)
        gauge("miniinfer:kv_blocks_total", "KV cache blocks in the pool.").set(
            manager.num_blocks)
        self.healthy = gauge("miniinfer:engine_healthy", "1 while the engine can serve; 0 "
                             "once it cannot (GET /health says why), until the server exits.")
        self.healthy.set(1)
        # What runs, as one info metric (vLLM's cache_config_info does the same for its cache).
        Info("miniinfer:engine_config", "The engine's settings (EngineConfig).", label,
             registry=r).labels(model_name).info(
                 {k: str(v) for k, v in engine.config.describe().items()})
        if engine.config.speculative is not None:  # chapter 14's drafts
            r.register(_SpeculationCollector(engine.stats, model_name))

    def first_token(self, request: Request) -> None:
        """A request's first token: its prompt was looked up when it was admitted."""
        self.prefix_queries.inc(len(request.prompt_ids))
        self.prefix_hits.inc(request.num_cached_tokens)
        t = request.timeline
        self.ttft.observe(t.first_token - t.arrival)

    def tokens(self, request: Request, start: int) -> None:
        """The gaps before each output token from index ``start`` on."""
        times = request.timeline.token_times
        for i in range(max(start, 1), len(times)):
            self.itl.observe(times[i] - times[i - 1])

    def preempted(self, num_requests: int) -> None:
        self.preemptions.inc(num_requests)

    def finished(self, request: Request) -> None:
        """Count a request that left the engine (its timeline is complete)."""
        t = request.timeline
        reason = request.finish_reason
        self._requests.labels(self.model_name, "stop" if reason in (
            FinishReason.EOS, FinishReason.STOP) else reason.value).inc()
        self.prompt_tokens.inc(len(request.prompt_ids))
        self.generation_tokens.inc(len(request.output_ids))
        n = len(t.token_times)
        if n > 1:
            self.tpot.observe((t.token_times[-1] - t.first_token) / (n - 1))
        if reason is not FinishReason.ABORT and t.first_token is not None:
            self.e2e.observe(t.finish - t.arrival)

    def failed(self) -> None:
        self._requests.labels(self.model_name, "error").inc()

    def engine_failed(self) -> None:
        self.healthy.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpeculationCollector(Collector):
    """vLLM's speculative-decoding counters, read from the engine's running totals at scrape
    time (``SpeculativeEngine.stats``): request-steps that verified a draft, draft tokens
    proposed, draft tokens accepted. Acceptance rate = accepted / draft tokens."""

    def __init__(self, stats, model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self):
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Request-steps that verified a draft.",
                 self.stats.drafted_steps),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                 self.stats.drafted),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 self.stats.accepted)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
