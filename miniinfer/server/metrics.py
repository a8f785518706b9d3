"""``GET /metrics``: the server's counters, latency histograms and gauges in Prometheus' text
format, named like vLLM's (``vllm:time_to_first_token_seconds`` is our
``miniinfer_time_to_first_token_seconds``). Latencies come from each request's timeline in the
engine (arrival at the server to the step that produced the token), so they leave out the
HTTP hop that a client's own measurement includes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..core.scheduler import FinishReason, Request
from ..engines.continuous import ContinuousEngine

# From a few ms (a GPU decode) to minutes (a long answer on a busy CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """One registry per server, so several servers in one process (tests) keep apart."""

    def __init__(self, engine: ContinuousEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("miniinfer_requests", "Requests that ended, by finish reason "
                                "(stop, length, abort, error).", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("miniinfer_prompt_tokens", "Prompt tokens of requests "
                                     "that ended.", registry=r)
        self.generation_tokens = Counter("miniinfer_generation_tokens", "Tokens generated.",
                                         registry=r)
        self.ttft = Histogram("miniinfer_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("miniinfer_time_per_output_token_seconds", "Per request: (last "
                              "token - first token) / (output tokens - 1).",
                              buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("miniinfer_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        scheduler = engine.scheduler
        manager = engine.kv_cache.block_manager
        # Read at scrape time, from the handler's thread: a length or a number the engine
        # thread updates is a consistent snapshot under the GIL.
        Gauge("miniinfer_num_requests_running", "Requests holding KV blocks.",
              registry=r).set_function(lambda: len(scheduler.running))
        Gauge("miniinfer_num_requests_waiting", "Requests queued for admission.",
              registry=r).set_function(lambda: len(scheduler.waiting))
        Gauge("miniinfer_kv_blocks_in_use", "KV cache blocks held by requests.",
              registry=r).set_function(lambda: manager.num_blocks - manager.num_free_blocks)
        Gauge("miniinfer_kv_blocks_total", "KV cache blocks in the pool.",
              registry=r).set(manager.num_blocks)
        # The prefix-cache stage (chapter 09) reports its hit rate as
        # ``prefix_cache_hit_rate``; an engine without a prefix cache never hits.
        Gauge("miniinfer_prefix_cache_hit_rate", "Share of prompt tokens found in the prefix "
              "cache (0 without one).", registry=r).set_function(
            lambda: float(getattr(engine, "prefix_cache_hit_rate", 0.0)))

    def finished(self, request: Request) -> None:
        """Count a request that left the engine (its timeline is complete)."""
        t = request.timeline
        reason = request.finish_reason
        self.requests.labels("stop" if reason in (FinishReason.EOS, FinishReason.STOP)
                             else reason.value).inc()
        self.prompt_tokens.inc(len(request.prompt_ids))
        self.generation_tokens.inc(len(request.output_ids))
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
            n = len(t.token_times)
            if n > 1:
                self.tpot.observe((t.token_times[-1] - t.first_token) / (n - 1))
        if reason is not FinishReason.ABORT:
            self.e2e.observe(t.finish - t.arrival)

    def failed(self) -> None:
        self.requests.labels("error").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
