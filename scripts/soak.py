"""A bounded soak of ``miniinfer serve`` (issue 68, item 5; ``make soak``).

A server on the tiny model in a child process, over loopback, takes minutes of mixed load:
plain completions, streamed chat completions, and streams the client cancels after the first
chunk. Before and after the measured run (each after a warm-up and once the server is idle) it
reads the server process's resident memory (``/proc/PID/status`` VmRSS), its open file
descriptors (``/proc/PID/fd``) and the KV blocks in use (``/metrics``), and fails unless they are
flat:

- KV blocks in use: 0 at both ends (every finished or cancelled request gave its blocks back);
- open file descriptors: at most ``--fd-slack`` (2) more at the end;
- RSS: at most ``--rss-slack-mib`` (32 MiB) more at the end. The warm-up has already paid for
  the allocator's pools, the tokenizer's caches and the worker threads; a leak of a few KB per
  request over thousands of requests shows up here, the allocator's noise does not.

The server runs any engine preset with any settings (issue 79, item 3): ``--engine
quantized`` (int4 weights, compiled forward), ``--engine speculative`` (drafts, whose blocks a
cancelled stream must give back too), ``--engine prefix-cache``, ``--engine tensor-parallel``;
arguments after ``--`` go to ``miniinfer serve`` as they are.

    python scripts/soak.py --seconds 180
    python scripts/soak.py --seconds 120 --engine speculative -- --num-draft-tokens 6
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miniinfer.server import ServerProcess  # noqa: E402


@dataclass
class Snapshot:
    rss_mib: float
    fds: int
    kv_blocks_in_use: int

    def __str__(self) -> str:
        return (f"RSS {self.rss_mib:.1f} MiB, open fds {self.fds}, "
                f"KV blocks in use {self.kv_blocks_in_use}")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def snapshot(pid: int, url: str) -> Snapshot:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(next(line for line in status.splitlines() if line.startswith("VmRSS:"))
                  .split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    blocks = metric(httpx.get(url + "/metrics", timeout=30).text, "miniinfer:kv_blocks_in_use")
    return Snapshot(rss_kib / 1024, fds, int(blocks))


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Until no request runs or waits (aborted streams are freed a step later)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=30).text
        if (metric(text, "vllm:num_requests_running") == 0
                and metric(text, "vllm:num_requests_waiting") == 0
                and metric(text, "miniinfer:kv_blocks_in_use") == 0):
            return
        time.sleep(0.1)
    raise TimeoutError("the server did not go idle")


@dataclass
class Counts:
    plain: int = 0
    streamed: int = 0
    cancelled: int = 0
    failed: int = 0


async def plain(client: httpx.AsyncClient, rng: random.Random, counts: Counts) -> None:
    body = {"model": "tiny", "prompt": f"Request {rng.random()} says", "temperature": 0.8,
            "max_tokens": rng.randint(1, 24), "seed": rng.randint(0, 1000)}
    response = await client.post("/v1/completions", json=body)
    if response.status_code == 200 and response.json()["choices"]:
        counts.plain += 1
    else:
        counts.failed += 1


async def streamed(client: httpx.AsyncClient, rng: random.Random, counts: Counts,
                   cancel: bool) -> None:
    body = {"model": "tiny", "stream": True, "max_tokens": rng.randint(8, 48),
            "messages": [{"role": "user", "content": f"Tell me about {rng.random()}"}],
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            counts.failed += 1
            return
        async for line in response.aiter_lines():
            if cancel and line.startswith("data: {"):
                counts.cancelled += 1
                return  # leaving the block closes the connection: the server aborts it
            if line == "data: [DONE]":
                counts.streamed += 1
                return
    counts.failed += 1


async def load(url: str, seconds: float, concurrency: int, seed: int) -> Counts:
    counts = Counts()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency * 2)

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            while time.monotonic() < deadline:
                kind = rng.random()
                try:
                    if kind < 0.4:
                        await plain(client, rng, counts)
                    else:
                        await streamed(client, rng, counts, cancel=kind > 0.7)
                except httpx.HTTPError:
                    counts.failed += 1

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="the measured run")
    parser.add_argument("--warmup-seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rss-slack-mib", type=float, default=32.0)
    parser.add_argument("--fd-slack", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", default="continuous", help="the preset the server runs")
    parser.add_argument("serve_args", nargs="*", help="more arguments for miniinfer serve")
    args = parser.parse_args()
    with ServerProcess("tiny", "--engine", args.engine, "--max-num-seqs", "16",
                       *args.serve_args) as server:
        pid = server.process.pid
        print(f"soak: {args.engine} server pid {pid} at {server.url}; warm-up "
              f"{args.warmup_seconds:g} s", flush=True)
        asyncio.run(load(server.url, args.warmup_seconds, args.concurrency, args.seed + 1))
        wait_idle(server.url)
        start = snapshot(pid, server.url)
        print(f"soak: start: {start}", flush=True)
        t0 = time.monotonic()
        counts = asyncio.run(load(server.url, args.seconds, args.concurrency, args.seed))
        elapsed = time.monotonic() - t0
        wait_idle(server.url)
        end = snapshot(pid, server.url)
        healthy = httpx.get(server.url + "/health", timeout=30).status_code == 200
        print(f"soak: end:   {end}", flush=True)
    total = counts.plain + counts.streamed + counts.cancelled
    print(f"soak: {total} requests in {elapsed:.0f} s ({counts.plain} plain, {counts.streamed} "
          f"streamed, {counts.cancelled} cancelled after their first chunk), {counts.failed} "
          f"failed; health {'200' if healthy else 'not 200'}")
    growth = end.rss_mib - start.rss_mib
    print(f"soak ({args.engine}): RSS {growth:+.1f} MiB (bound +{args.rss_slack_mib:g}), fds "
          f"{end.fds - start.fds:+d} (bound +{args.fd_slack}), KV blocks in use "
          f"{start.kv_blocks_in_use} -> {end.kv_blocks_in_use} (bound 0)")
    problems = [what for what, bad in (
        ("RSS grew", growth > args.rss_slack_mib),
        ("file descriptors leaked", end.fds - start.fds > args.fd_slack),
        ("KV blocks stayed in use", end.kv_blocks_in_use or start.kv_blocks_in_use),
        ("requests failed", counts.failed), ("health is not 200", not healthy),
        ("no requests ran", total == 0)) if bad]
    if problems:
        print(f"soak ({args.engine}): FAILED: {', '.join(problems)}", file=sys.stderr)
        return 1
    print(f"soak ({args.engine}): flat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
