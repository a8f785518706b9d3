"""Online serving benchmark (chapter 08): a workload that arrives over time (``workloads``),
three ways to serve it (``systems``), the metrics serving systems are judged by (``metrics``),
and the benchmark that runs them (``benchmark``).

- **Workload**: ``num_requests`` requests with Poisson arrivals at ``request_rate`` per second
  (``inf``: all at once, the offline case), prompt and output lengths drawn uniformly from
  ranges, or prompts (and output lengths) sampled from a JSONL dataset file. Seeded: the same
  config gives the same requests, token for token, to every system.
- **Systems**: ``continuous`` (our chapter 08 engine; ``prefix-cache`` is chapter 09's),
  ``static-<engine>`` (request-level
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


from .benchmark import ServingBenchConfig, ServingResults, run_serving_bench, summary_table
from .metrics import (
    LATENCIES,
    PERCENTILES,
    median_of_repeats,
    request_table,
    step_table,
    summarize,
)
from .systems import (
    HF_CB_BLOCK_SIZE,
    STATIC_PREFIX,
    STEPPED_SYSTEMS,
    ServedRequest,
    ServingRun,
    Systems,
    check_system,
    default_pool_bytes,
    serve_continuous,
    serve_hf_cb,
    serve_static,
)
from .workloads import (
    WORKLOAD_KINDS,
    WorkloadConfig,
    WorkloadRequest,
    make_workload,
    read_dataset,
)

__all__ = [
    "HF_CB_BLOCK_SIZE", "LATENCIES", "PERCENTILES", "STATIC_PREFIX", "STEPPED_SYSTEMS",
    "WORKLOAD_KINDS", "ServedRequest",
    "ServingBenchConfig", "ServingResults", "ServingRun", "Systems", "WorkloadConfig",
    "WorkloadRequest", "check_system", "default_pool_bytes", "make_workload", "median_of_repeats",
    "read_dataset",
    "request_table", "run_serving_bench", "serve_continuous", "serve_hf_cb", "serve_static",
    "step_table", "summarize", "summary_table",
]
