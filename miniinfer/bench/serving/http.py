"""The serving benchmark over HTTP (chapter 10): chapter 08's seeded workloads sent to a running
``miniinfer serve`` (or any server that speaks OpenAI's completions API with vLLM's
``ignore_eos`` and ``return_token_ids`` extensions), measured at the client.

Every request is a streamed completion whose prompt is the workload's token ids, so the server
does no tokenizing and generates exactly the requested number of tokens. The timeline of each
request is stamped by the client: arrival when the request is sent, "scheduled" when the
response headers come back, one stamp per token when the chunk carrying it arrives (TTFT = the
first streamed chunk), finish at the last chunk. The metrics are then chapter 08's, so a run
over HTTP and a run in-process compare like for like.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pandas as pd

from ...core.errors import InvalidRequestError
from ...core.models import LoadedModel, dtype_name
from ...core.scheduler import RequestTimeline
from ..devices import run_metadata
from .benchmark import ServingResults
from .metrics import request_table, summarize
from .systems import ServedRequest, ServingRun
from .workloads import WorkloadConfig, WorkloadRequest, make_workload

HTTP_SYSTEM = "http"


async def _send(client: httpx.AsyncClient, model: str, w: WorkloadRequest,
                send_at: float) -> ServedRequest:
    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    body = {"model": model, "prompt": w.prompt_ids, "max_tokens": w.max_new_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    timeline = RequestTimeline(time.perf_counter())
    output_ids: list[int] = []
    async with client.stream("POST", "/completions", json=body) as response:
        timeline.first_scheduled = time.perf_counter()
        if response.status_code != 200:
            raise RuntimeError(f"request {w.index}: HTTP {response.status_code}: "
                               f"{(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"request {w.index}: {chunk['error']['message']}")
            choice = chunk["choices"][0]
            ids = choice.get("token_ids")  # vLLM's extension, and ours
            if ids is None:
                # llama-server streams one token a chunk as text only (its id unknown here:
                # -1), and ends with a chunk that carries none but the finish reason.
                ids = [] if choice.get("finish_reason") else [-1]
            output_ids += ids
            timeline.token_times += [now] * len(ids)
    timeline.finish = timeline.token_times[-1]
    return ServedRequest(w.index, len(w.prompt_ids), output_ids, timeline)


async def _serve(base_url: str, model: str, workload: Sequence[WorkloadRequest],
                 max_concurrency: int | None = None) -> ServingRun:
    # No connection limit: every request of the workload may be in flight at once, or at most
    # max_concurrency of them (that many clients, each sending its next request when its last
    # one has finished, as vLLM's benchmark does with --max-concurrency).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def send(w: WorkloadRequest, send_at: float) -> ServedRequest:
        if gate is None:
            return await _send(client, model, w, send_at)
        async with gate:
            return await _send(client, model, w, send_at)

    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        served = await client.get("/models")
        served.raise_for_status()
        names = [m["id"] for m in served.json()["data"]]
        if model not in names:
            raise InvalidRequestError(f"the server at {base_url} serves {', '.join(names)}, "
                                      f"not {model}")
        start = time.perf_counter()
        requests = await asyncio.gather(*(send(w, start + w.arrival_s) for w in workload))
    return ServingRun(HTTP_SYSTEM, start, sorted(requests, key=lambda r: r.index))


def serve_http(base_url: str, model: str, workload: Sequence[WorkloadRequest],
               max_concurrency: int | None = None) -> ServingRun:
    """Send the workload to the server at ``base_url`` (ending in ``/v1``) in real time, at
    most ``max_concurrency`` requests in flight (None: no limit)."""
    # A thread of its own: where an event loop already runs (Jupyter's), asyncio.run refuses.
    with ThreadPoolExecutor(max_workers=1) as worker:
        return worker.submit(asyncio.run, _serve(base_url.rstrip("/"), model, workload,
                                                 max_concurrency)).result()


def run_http_bench(lm: LoadedModel, base_url: str, workload: WorkloadConfig,
                   request_rates: Sequence[float] = (), warmup: bool = True,
                   chapter: str = "10", repeats: int = 1) -> ServingResults:
    """bench-serving's HTTP mode: one run per request rate (none: the workload's own), each
    after a short warm-up, ``repeats`` rounds of them; returns chapter 08's tables (system
    ``http``; no steps: the client does not see them).
    ``lm`` gives the tokenizer and vocabulary the seeded workload is drawn from; it must be
    the model the server serves."""
    meta = run_metadata(lm.device)
    tags = {"chapter": chapter, "model": lm.name, "dtype": dtype_name(lm.dtype),
            "system": HTTP_SYSTEM, "max_num_batched_tokens": math.nan}
    runs, requests = [], []
    if repeats < 1:
        raise InvalidRequestError(f"repeats must be >= 1, got {repeats}")
    plan = [(repeat, rate) for repeat in range(repeats)
            for rate in request_rates or (workload.request_rate,)]
    for repeat, rate in plan:
        if warmup:
            serve_http(base_url, lm.name, [replace(w, max_new_tokens=4) for w in make_workload(
                lm, replace(workload, num_requests=4, request_rate=math.inf))])
        run = serve_http(base_url, lm.name, make_workload(lm, replace(workload,
                                                                      request_rate=rate)))
        runs.append({**tags, "request_rate": rate, "repeat": repeat, **summarize(run)})
        requests.append(request_table(run).assign(**tags, request_rate=rate, repeat=repeat))
    w = workload
    workload_cols = {"num_requests_config": w.num_requests,
                     "prompt_len_range": f"{w.prompt_len[0]}-{w.prompt_len[1]}",
                     "output_len_range": f"{w.output_len[0]}-{w.output_len[1]}",
                     "dataset": Path(w.dataset).name if w.dataset else "", "seed": w.seed,
                     "base_url": base_url}
    return ServingResults(pd.DataFrame(runs).assign(**workload_cols, **meta),
                          pd.concat(requests, ignore_index=True).assign(**meta), pd.DataFrame())
