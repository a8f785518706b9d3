"""Chapter 15's recording: the whole engine (stage ``composed``) served over HTTP against the
servers a reader would otherwise deploy on a CPU, then what each optimisation is worth on top of
the others.

**Against the peers.** Our server (``serve --engine composed``), llama.cpp's ``llama-server`` on
the GGUF file SmolLM2 ships as (Q4_1, the blocks our int4 weights are made of) and vLLM's CPU
server where it is built (``make peers``), each driven by chapter 10's client with the same
requests: chat with a shared system prompt, input-grounded requests (quote, extract, correct a
text) and short open-ended chat, from 1, 4 and 16 clients, each client sending its next request
when its last one is answered. Greedy, a fixed number of new tokens, EOS ignored, so every
system writes the same number of tokens. Per run: output tok/s, TTFT and TPOT p50/p99, and the
server's peak resident memory.

**The ablation.** In-process, the composed engine and the same engine with one optimisation
removed at a time (int4 weights, the compiled forward, prefix caching, speculation), on the same
requests from 4 clients; where two removals share a forward they share its runner, so no run
waits on a compile.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..bench.devices import LoadGuard, device_slug, recording_root, run_metadata
from ..bench.peers import PeerMissingError
from ..bench.serving.http import serve_http
from ..bench.serving.metrics import summarize
from ..bench.serving.workloads import WorkloadRequest
from ..core.models import (
    LoadedModel,
    chat_text,
    dtype_name,
    load_model,
    resolve_device,
    smollm2_gguf,
)
from ..core.sampling import SamplingParams
from ..engines import make_engine
from .speculation import OPEN_ENDED, TEXT, input_grounded_tasks

SYSTEM_PROMPT = (
    "You are the help desk of a public library. Answer in plain English, in at most five "
    "sentences. The library opens at nine and closes at six on weekdays, at one on Saturdays, "
    "and is closed on Sundays. Members may borrow twelve books for three weeks, renew twice "
    "online, and reserve up to five titles. Late returns cost twenty cents a day per book. The "
    "reading room is silent; group rooms on the second floor can be booked for two hours. Wi-Fi "
    "is free with a library card. Children's story time is on Wednesdays at ten.")
CHAT_QUESTIONS = (
    "Can I renew a book I borrowed three weeks ago?",
    "When is the library open on Saturday?",
    "How many books can I borrow at once?",
    "Where can my study group meet?",
    "Is there anything for children during the week?",
    "What happens if I return a book late?",
)
# Each optimisation off, one at a time, by the setting that turns it off.
ABLATION = {
    "composed": {},
    "- int4 (fp32 weights)": {"weights": "dense"},
    "- compiled (eager)": {"forward": "direct"},
    "- prefix caching": {"prefix_caching": False},
    "- speculation": {"speculative": None},
}


@dataclass(frozen=True, slots=True)
class DeployConfig:
    clients: tuple[int, ...] = (1, 4, 16)
    requests_per_client: int = 2  # a run sends clients x this many requests
    new_tokens: int = 64
    served_repeats: int = 2  # runs of each (workload, clients) per server, after its warm-up
    systems: tuple[str, ...] = ("composed", "llama-server", "vllm")
    ablation_clients: int = 4
    ablation_repeats: int = 2
    ablation_workloads: tuple[str, ...] = ("chat", "grounded")
    # Settings under every variant of the ablation (a rehearsal's: the eager forward).
    base_settings: tuple[tuple[str, object], ...] = ()
    ablation: tuple[str, ...] = tuple(ABLATION)
    server_timeout_s: float = 1800.0  # ours compiles every bucket before it answers


def workloads(lm: LoadedModel, text_path: Path = TEXT) -> dict[str, list[list[int]]]:
    """Chat-formatted prompt ids per workload."""
    tok = lm.tokenizer
    tasks = input_grounded_tasks(text_path.read_text())

    def ids(messages: list[dict[str, str]]) -> list[int]:
        return tok.encode(chat_text(tok, messages), add_special_tokens=False)

    return {
        "chat": [ids([{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": q}]) for q in CHAT_QUESTIONS],
        "grounded": [ids([{"role": "user", "content": t}])
                     for t in tasks["copy"] + tasks["rewrite"]],
        "open-ended": [ids([{"role": "user", "content": t}]) for t in OPEN_ENDED],
    }


def requests_for(prompts: list[list[int]], clients: int, config: DeployConfig
                 ) -> list[WorkloadRequest]:
    """The run's requests: the workload's prompts in turn, all due at once (the clients
    then send them as they free up)."""
    n = clients * config.requests_per_client
    return [WorkloadRequest(i, 0.0, prompts[i % len(prompts)], config.new_tokens)
            for i in range(n)]


def _process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux's /proc/<pid>/task/<tid>/children)."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in children.read_text().split()]
            except OSError:
                pass
    return tree


def peak_rss_mib(pid: int) -> float:
    """A server's peak resident memory in MiB: Linux's VmHWM of the process and of every
    process it started (vLLM's engine core runs in a child), summed: an upper bound where their
    peaks came at different times. NaN where unknown."""
    total = float("nan")
    for member in _process_tree(pid):
        try:
            lines = Path(f"/proc/{member}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("VmHWM:"):
                total = (0.0 if total != total else total) + int(line.split()[1]) / 1024
    return total


def _start(system: str, lm: LoadedModel, config: DeployConfig):
    """The server of ``system`` (a context manager with ``base_url`` and ``process``); raises
    PeerMissingError where a peer is not built."""
    if system == "composed":
        from ..server.process import ServerProcess

        return ServerProcess(lm.name, "--engine", "composed", "--device", "cpu",
                             timeout=config.server_timeout_s)
    if system == "llama-server":
        from ..bench.peers.llama_server import start_llama_server

        return start_llama_server(smollm2_gguf(), lm.name, parallel=max(config.clients),
                                  port=8002)
    if system == "vllm":
        from ..bench.peers import find_vllm
        from ..bench.peers.vllm_server import start_vllm_server
        from ..core.models import smollm2_cache

        find_vllm()
        return start_vllm_server(smollm2_cache(), lm.name, port=8001)
    raise ValueError(f"unknown system {system!r}")


def served_rows(lm: LoadedModel, config: DeployConfig, prompts: dict[str, list[list[int]]],
                log: Callable[[str], None] = print) -> list[dict]:
    """Every system, workload and client count over HTTP; one row each."""
    rows = []
    for system in config.systems:
        try:
            server = _start(system, lm, config)
        except PeerMissingError as missing:
            log(f"{system}: skipped ({missing})")
            continue
        with server:
            runs = [(w, c) for w in prompts for c in config.clients]
            for workload, clients in tqdm(runs, desc=system, leave=False):
                # A short warm-up of the run's shape, then the run.
                warm_up = [replace(w, max_new_tokens=8) for w in
                           requests_for(prompts[workload], clients, config)[:clients]]
                serve_http(server.base_url, lm.name, warm_up, max_concurrency=clients)
                runs_of = [summarize(serve_http(server.base_url, lm.name,
                                                requests_for(prompts[workload], clients, config),
                                                max_concurrency=clients))
                           for _ in range(config.served_repeats)]
                rows.append({"part": "peers", "system": system, "workload": workload,
                             "clients": clients, **median_run(runs_of)})
            memory = peak_rss_mib(server.process.pid)
        for row in rows:
            if row["system"] == system:
                row["peak_rss_mib"] = memory
    return rows


def median_run(runs: list[dict]) -> dict:
    """The run of median output tok/s (its latencies with it), and the range of all runs."""
    ranked = sorted(runs, key=lambda r: r["output_throughput"])
    rates = [r["output_throughput"] for r in ranked]
    return {**ranked[(len(ranked) - 1) // 2], "output_throughput_min": rates[0],
            "output_throughput_max": rates[-1], "repeats": len(runs)}


def _closed_loop(engine, requests: list[list[int]], clients: int,
                 params: SamplingParams) -> float:
    """Output tok/s with ``clients`` requests in flight, each replaced when it finishes."""
    queue = list(requests)
    start = time.perf_counter()
    in_flight = 0
    while queue or in_flight:
        while queue and in_flight < clients:
            engine.add_request(queue.pop(0), params)
            in_flight += 1
        in_flight -= sum(1 for r in engine.step().outputs if r.finished)
    return len(requests) * params.max_new_tokens / (time.perf_counter() - start)


def ablation_rows(lm: LoadedModel, config: DeployConfig,
                  prompts: dict[str, list[list[int]]]) -> list[dict]:
    """The composed engine and each removal on every workload from ``ablation_clients``
    clients, in-process, repeats interleaved; one row per (variant, workload)."""
    params = SamplingParams(max_new_tokens=config.new_tokens, ignore_eos=True)
    runners: dict[tuple, object] = {}
    engines = {}
    for name in config.ablation:
        settings = {**dict(config.base_settings), **ABLATION[name]}
        # Graphs compiled as the warm-up round meets them, not every bucket up front.
        engine = make_engine("composed", lm, warm_up=False, **settings,
                             **_shared_runner(runners, settings))
        runners.setdefault(_runner_key(engine.config), engine.runner)
        engines[name] = engine
    rates: dict[tuple[str, str], list[float]] = {}
    rounds = [(r, w, name) for r in range(config.ablation_repeats + 1)
              for w in config.ablation_workloads for name in engines]
    for repeat, workload, name in tqdm(rounds, desc="ablation", leave=False):
        engine = engines[name]
        engine.reset_prefix_cache()
        batch = [p for p in prompts[workload]
                 for _ in range(-(-config.ablation_clients * 2 // len(prompts[workload])))]
        rate = _closed_loop(engine, batch[:config.ablation_clients * 2],
                            config.ablation_clients, params)
        if repeat:  # the first round warms up (compiles the shapes it meets)
            rates.setdefault((name, workload), []).append(rate)
    return [{"part": "ablation", "system": name, "workload": workload,
             "clients": config.ablation_clients, "output_throughput": statistics.median(r),
             "output_throughput_min": min(r), "output_throughput_max": max(r),
             "repeats": len(r)} for (name, workload), r in rates.items()]


def _runner_key(config) -> tuple:
    # What a runner is built from; prefix caching changes its block manager.
    return (config.weights, config.forward, config.prefix_caching)


def _shared_runner(runners: dict[tuple, object], settings: dict) -> dict:
    from ..engines import engine_config

    key = _runner_key(engine_config("composed", **settings))
    return {"runner": runners[key]} if key in runners else {}


def results_path(device: torch.device) -> Path:
    return recording_root() / "ch15" / f"{device_slug(device)}-composed.csv"


def record_deploy(device: torch.device | str | None = "cpu", config: DeployConfig | None = None,
                  lm: LoadedModel | None = None, out: Path | None = None) -> Path:
    """``make chapter-15``: the peers over HTTP, then the ablation in-process; one CSV."""
    dev = resolve_device(device)
    config = config or DeployConfig()
    lm = lm or load_model("smollm2-135m", device=dev)
    prompts = workloads(lm)
    with LoadGuard(torch.get_num_threads() if dev.type == "cpu" else 1) as guard:
        rows = served_rows(lm, config, prompts)
        rows += ablation_rows(lm, config, prompts)
    from ..bench.peers.llama_cpp import version as llama_version

    meta = {**run_metadata(dev), "model": lm.name, "dtype": dtype_name(lm.dtype),
            "new_tokens": config.new_tokens,
            "llama_cpp": llama_version(), **guard.columns()}
    df = pd.DataFrame([{**meta, **row} for row in rows])
    out = out or results_path(dev)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(df[["part", "system", "workload", "clients", "output_throughput"]].round(1)
          .to_string(index=False))
    print(f"wrote {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    def counts(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(c) for c in text.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"need client counts >= 1, e.g. 1,4,16; got {text!r}")
        return values

    parser.add_argument("--clients", type=counts, default=(1, 4, 16),
                        help="client counts, comma-separated")
    defaults = DeployConfig()
    parser.add_argument("--systems", default=",".join(defaults.systems))
    parser.add_argument("--no-ablation", action="store_true")
    args = parser.parse_args(argv)
    config = DeployConfig(clients=args.clients,
                          systems=tuple(args.systems.split(",")),
                          ablation=() if args.no_ablation else defaults.ablation)
    record_deploy("cpu", config)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
