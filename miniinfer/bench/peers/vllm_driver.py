"""vLLM's side of the peer protocol. The peer venv's python runs this file as a script: it
imports the standard library and vllm only (never miniinfer, whose deps that venv lacks).

    .venv-peers/bin/python vllm_driver.py --model DIR --dtype float32 [--max-num-batched-tokens N]

Protocol, JSON lines: once the engine is built the driver writes ``{"ready": true,
"vllm_version": ..., ...}``; then it answers every job line read from stdin with one line, and
stops at the end of stdin. A job::

    {"requests": [{"prompt_ids": [...], "max_tokens": 64, "arrival_s": 0.0}, ...],
     "sampling": {"temperature": 0.0, "ignore_eos": true, ...},
     "warmup": 0, "repeat": 1, "reset_prefix_cache": true, "profile": false,
     "profile_steps": null}

its answer ``{"runs": [{"duration_s": ..., "requests": [{"token_ids": [...], "scheduled_s":
..., "token_times_s": [...]}, ...]}, ...]}`` (one run per repeat, times in seconds from the
run's start), with ``"ops": [{"op": ..., "calls": ..., "self_ms": ..., "total_ms": ...}, ...]``
for a profiled job (the last run's, under torch.profiler), ``"window": {"steps": n,
"wall_s": ..., "step_s": [...], "ops": [...]}`` for a job with ``"profile_steps":
{"warm_steps": w, "steps": n}`` (the last run's steps ``w + 1`` to ``w + n`` after every
request had its first token, all decodes then, under torch.profiler: a decode step of the batch
alone; with ``"profile": false`` in it, the same steps timed with no profiler and ``ops``
empty), or ``{"error": "..."}``.
A window may add ``"joiners": [[prompt_ids, ...], ...]``, the new prompts (one token each,
not in the run's answer) added before each of its ``w + n`` steps: a profiled step is then the
batch's decodes and those prompts whole, as a served step that admits new requests is. Only the
answers go to stdout: vLLM's logs, and anything else that writes to file descriptor 1 (its
engine process too), go to stderr.

A run is what ``LLM.generate`` does with every request at once, the engine's own ``step()``
loop, with two differences that let it time each token: each step returns its new tokens
(``generate`` asks for the final outputs only), and a request with ``arrival_s > 0`` is added
when its time has come (chapter 08's arrivals), before the next step. Tokens are not
detokenized: our engines return token ids too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO


def _protocol_stream() -> TextIO:
    """A private copy of stdout for the answers; fd 1 itself (and so every print, log line
    and child process) is pointed at stderr."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def _sampling_params(max_tokens: int, sampling: dict[str, Any]):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA,
                          detokenize=False, **sampling)


def serve_once(llm, requests: list[dict[str, Any]], sampling: dict[str, Any],
               window: dict[str, int] | None = None) -> dict[str, Any]:
    """One run: every request added at its arrival, the engine stepped until all are done;
    each new token stamped when the step that made it returns. ``window``: profile some decode
    steps (see the module's docstring)."""
    engine = llm.llm_engine
    profiler = _StepWindow(window, len(requests)) if window else None
    order = sorted(range(len(requests)), key=lambda i: requests[i].get("arrival_s", 0.0))
    params = [_sampling_params(r["max_tokens"], sampling) for r in requests]
    out = [{"token_ids": [], "scheduled_s": None, "token_times_s": []} for _ in requests]
    start = time.perf_counter()
    # Ids unique across runs: vLLM refuses an id still known from an earlier request.
    tag = f"{start:.6f}"
    # The run's own requests by id (a window's joiners are not among them).
    records = {f"{tag}-{i}": record for i, record in enumerate(out)}
    while order or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + requests[order[0]].get("arrival_s", 0.0)
                           - time.perf_counter()))
        now = time.perf_counter() - start
        while order and requests[order[0]].get("arrival_s", 0.0) <= now:
            i = order.pop(0)
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": requests[i]["prompt_ids"]},
                               params[i])
            out[i]["scheduled_s"] = time.perf_counter() - start
        if profiler is not None:
            joiners = profiler.before_step(not order and all(r["token_ids"] for r in out))
            for k, prompt in enumerate(joiners):
                engine.add_request(f"{tag}-joiner-{profiler.after_first}-{k}",
                                   {"prompt_token_ids": prompt}, _sampling_params(1, sampling))
        outputs = engine.step()
        if profiler is not None:
            profiler.after_step(len(outputs))
        for output in outputs:
            stamp = time.perf_counter() - start
            record = records.get(output.request_id)
            if record is None:
                continue  # a joiner's one token
            new = list(output.outputs[0].token_ids)
            record["token_ids"] += new
            record["token_times_s"] += [stamp] * len(new)
    run = {"duration_s": time.perf_counter() - start, "requests": out}
    return run if profiler is None else {**run, "window": profiler.result()}


class _StepWindow:
    """torch.profiler over ``window["steps"]`` engine steps, which start ``window["warm_steps"]``
    steps after every request has its first token; each must give every request a token, and
    every joiner added before it its first (and only) one."""

    def __init__(self, window: dict[str, Any], num_requests: int) -> None:
        self.warm, self.steps, self.num_requests = window["warm_steps"], window["steps"], \
            num_requests
        self.joiners = window.get("joiners") or []
        self.profile = window.get("profile", True)
        if self.joiners and len(self.joiners) != self.warm + self.steps:
            raise ValueError(f"a window of {self.warm} + {self.steps} steps needs as many lists "
                             f"of joiners, got {len(self.joiners)}")
        self.after_first = 0  # steps since every request had its first token
        self.prof, self.step_start, self.expected = None, None, 0
        self.step_s: list[float] = []

    def before_step(self, all_started: bool) -> list[list[int]]:
        """Starts the profiler and the step's clock where the window does -> the prompts that
        join this step."""
        self.step_start = None
        if not all_started or self.after_first == self.warm + self.steps:
            return []
        self.after_first += 1
        if self.after_first == self.warm + 1 and self.profile:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.start()
        joining = self.joiners[self.after_first - 1] if self.joiners else []
        self.expected = self.num_requests + len(joining)
        if self.after_first > self.warm:
            self.step_start = time.perf_counter()
        return joining

    def after_step(self, num_outputs: int) -> None:
        if self.step_start is None:
            return
        self.step_s.append(time.perf_counter() - self.step_start)
        last = self.after_first == self.warm + self.steps
        if self.prof is not None and (last or num_outputs != self.expected):
            self.prof.stop()
        if num_outputs != self.expected:
            raise RuntimeError(f"a profiled step gave {num_outputs} of {self.expected} "
                               f"requests a token: not a step of the whole batch"
                               + (" and its joiners" if self.joiners else ""))

    def result(self) -> dict[str, Any]:
        if self.after_first < self.warm + self.steps:
            raise RuntimeError(f"the run ended {self.after_first} steps after every request "
                               f"had its first token; the window needs "
                               f"{self.warm + self.steps}")
        return {"steps": self.steps, "wall_s": sum(self.step_s), "step_s": self.step_s,
                "ops": _ops(self.prof) if self.prof is not None else []}


def run_job(llm, job: dict[str, Any]) -> dict[str, Any]:
    requests, sampling = job["requests"], job.get("sampling", {})
    window = job.get("profile_steps")
    for _ in range(job.get("warmup", 0)):
        serve_once(llm, requests, sampling)
    runs, ops = [], None
    for _ in range(job.get("repeat", 1)):
        if job.get("reset_prefix_cache", True):
            llm.reset_prefix_cache()  # every run starts cold, like our prefix-cache engine
        if job.get("profile"):
            runs.append(None)
            runs[-1], ops = profiled(lambda: serve_once(llm, requests, sampling))
        else:
            runs.append(serve_once(llm, requests, sampling, window))
    return {"runs": runs} if ops is None else {"runs": runs, "ops": ops}


def profiled(run) -> tuple[Any, list[dict[str, Any]]]:
    """``run()`` under torch.profiler (CPU activity): its result and every op's totals, by
    self time. It sees the model's ops only where the engine runs in this process (the
    driver's ``--in-process``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run()
    return result, _ops(prof)


def _ops(prof) -> list[dict[str, Any]]:
    """Every op's calls, self and inclusive time under ``prof``, by self time."""
    ops = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
            "total_ms": e.cpu_time_total / 1e3} for e in prof.key_averages()]
    return sorted(ops, key=lambda op: -op["self_ms"])


def _engine_facts(llm) -> dict[str, Any]:
    """What the ready line reports about the engine as built."""
    config = llm.llm_engine.vllm_config
    return {"max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "enforce_eager": config.model_config.enforce_eager,
            "dtype": str(config.model_config.dtype).removeprefix("torch.")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--in-process", action="store_true",
                        help="run vLLM's engine core in this process (a profile can see it)")
    args = parser.parse_args(argv)
    answers = _protocol_stream()
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")

    try:
        import vllm
        from vllm import LLM

        options = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                     ("max_num_seqs", args.max_num_seqs)) if v is not None}
        llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, seed=args.seed,
                  enforce_eager=args.enforce_eager, served_model_name=args.served_model_name,
                  **options)
    except Exception as exc:  # the parent shows this line, the traceback is in the log
        import traceback

        traceback.print_exc()
        answer({"error": f"vLLM could not start: {type(exc).__name__}: {exc}"})
        return 1
    answer({"ready": True, "vllm_version": vllm.__version__, "pid": os.getpid(),
            **_engine_facts(llm)})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            result = run_job(llm, json.loads(line))
        except Exception as exc:
            import traceback

            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        answer(result)
    return 0


# vLLM's engine runs in a process of its own, started by spawning a fresh interpreter that
# imports this file again: without the guard, that import would start another driver.
if __name__ == "__main__":
    sys.exit(main())
