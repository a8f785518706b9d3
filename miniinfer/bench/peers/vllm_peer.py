"""vLLM as an engine (``bench --engines vllm``) and as a serving system (``bench-serving
--systems vllm``), run by the peer venv's python in a process of its own (:mod:`.vllm_driver`).

The driver is started once per engine and kept: the benchmark interleaves its runs with our
engines' (``generate`` sends one job per call), and vLLM's start-up (minutes the first time,
while torch.compile fills its on-disk cache) is paid once. vLLM gets the model from disk, the
same weights our engines run: SmolLM2's converted cache (config, tokenizer, safetensors), or,
for a random-weight model, the loaded model saved into a temporary directory. No hub access:
the driver's environment says so.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...core.errors import InvalidRequestError
from ...core.models import LoadedModel, smollm2_cache
from ...core.sampling import SamplingParams
from ...engines import Engine, GenerationResult, make_engine
from ...engines.base import batch_token_times
from . import PEERS_DIR, VLLM, PeerInstall, find_vllm

DRIVER = PEERS_DIR / "vllm_driver.py"
# VLLM_CPU_KVCACHE_SPACE, whole GiB (vLLM reads an integer). 1 GiB holds ~23k tokens of
# SmolLM2-135M in fp32, far more than a benchmark here keeps.
DEFAULT_KV_CACHE_GIB = 1
# The first start compiles the model (about 2 minutes on a 2-core machine); later starts read
# vLLM's compile cache.
STARTUP_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 30.0


class PeerFailedError(RuntimeError):
    """The peer process failed: the message gives its own error and the path of its log."""


def peer_env(kv_cache_gib: int) -> dict[str, str]:
    """The peer's environment: ours, offline (no hub, no usage reports), with its KV space."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


def peer_model_dir(lm: LoadedModel) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """A Hugging Face directory holding ``lm``'s weights, config and tokenizer, and the
    temporary directory to clean up afterwards (None for SmolLM2's own cache)."""
    if lm.name == "smollm2-135m":
        return smollm2_cache(), None
    tmp = tempfile.TemporaryDirectory(prefix=f"miniinfer-{lm.name}-")
    lm.model.save_pretrained(tmp.name)
    lm.tokenizer.save_pretrained(tmp.name)
    return Path(tmp.name), tmp


def log_tail(path: Path, lines: int = 5) -> str:
    try:
        tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return " | ".join(line.strip() for line in tail)


def stop_process(process: subprocess.Popen, log, stdin_grace_s: float = STOP_TIMEOUT_S) -> None:
    """End of stdin asks the driver to shut vLLM down (``stdin_grace_s`` 0: no stdin to close);
    then its process group (the driver or server, vLLM's engine and worker processes) gets
    SIGTERM, and SIGKILL 5 s later."""
    if process.poll() is None and stdin_grace_s > 0:
        try:
            process.stdin.close()
            process.wait(stdin_grace_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            continue
    log.close()


def session_cpu_seconds(session_id: int) -> float | None:
    """CPU time (user + system) of every live process in the session ``session_id``, from
    /proc; None where there is no /proc (not Linux)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    ticks = 0
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # The fields after the command name, which may hold spaces: state is the first.
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[3]) == session_id:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(session_id: int, busy_share: float = 0.1, window_s: float = 0.2,
                     timeout_s: float = 10.0) -> None:
    """Return once the session's processes use less than ``busy_share`` of one core over a
    ``window_s`` window (or after ``timeout_s``: a peer that never rests must not hang us)."""
    deadline = time.monotonic() + timeout_s
    last = session_cpu_seconds(session_id)
    while last is not None and time.monotonic() < deadline:
        time.sleep(window_s)
        now = session_cpu_seconds(session_id)
        if now - last < busy_share * window_s:
            return
        last = now


class PeerProcess:
    """A script run by the peer venv's python that speaks JSON lines (see the driver): started,
    asked, stopped. It runs in a session of its own, so a Ctrl-C here does not reach it
    half-way through a step; it is stopped when this object is closed or collected, or when
    the interpreter exits. Its log (stderr: vLLM's own logging) is removed by ``close`` unless
    something failed, when the error names it."""

    def __init__(self, python: Path, script: Path, args: Sequence[str], env: dict[str, str],
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        log = tempfile.NamedTemporaryFile("w", prefix=f"miniinfer-{script.stem}-", suffix=".log",
                                          delete=False)
        self.log_path = Path(log.name)
        self._keep_log = False
        self._process = subprocess.Popen(
            [str(python), str(script), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, text=True, env=env, start_new_session=True)
        self._finalizer = weakref.finalize(self, stop_process, self._process, log)
        self.ready = self._answer(startup_timeout_s)
        if not self.ready.get("ready"):
            self._keep_log = True
            self.close()
            raise PeerFailedError(f"{script.name} did not start: {self.ready}")

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one job and wait for its answer. After an error, or an interrupted wait, the
        process is stopped: what a failed step left in vLLM's engine is unknown, and an
        interrupted job's answer would arrive as the answer to the next."""
        if not self._finalizer.alive:
            raise PeerFailedError("the peer process has been stopped")
        try:
            try:
                self._process.stdin.write(json.dumps(message) + "\n")
                self._process.stdin.flush()
            except BrokenPipeError:
                self._process.wait()
                raise self._ended() from None
            answer = self._answer(None)
        except BaseException:
            self._keep_log = True
            self.close()
            raise
        # vLLM's CPU workers keep spinning for about a second after a job: a benchmark that
        # runs our engine next would time it on a busy core (seen: hf's TTFT 1.1 s, not 0.15).
        wait_until_quiet(self._process.pid)
        return answer

    def _answer(self, timeout_s: float | None) -> dict[str, Any]:
        if timeout_s is not None:
            with selectors.DefaultSelector() as selector:
                selector.register(self._process.stdout, selectors.EVENT_READ)
                if not selector.select(timeout_s):
                    self._keep_log = True
                    self.close()
                    raise PeerFailedError(f"no answer from the peer in {timeout_s:.0f} s; its "
                                          f"log: {self.log_path}")
        line = self._process.stdout.readline()
        if not line:
            self._process.wait()
            self._keep_log = True
            self.close()
            raise self._ended()
        answer = json.loads(line)
        if "error" in answer:
            self._keep_log = True
            raise PeerFailedError(f"{answer['error']} (log: {self.log_path})")
        return answer

    def _ended(self) -> PeerFailedError:
        return PeerFailedError(f"the peer process ended (status {self._process.returncode}); "
                               f"its log {self.log_path} ends: {log_tail(self.log_path)}")

    def close(self) -> None:
        self._finalizer()
        if not self._keep_log:
            self.log_path.unlink(missing_ok=True)


def _sampling(params: SamplingParams) -> dict[str, Any]:
    """Our sampling parameters in vLLM's names (the same meanings: temperature 0 is greedy,
    top_k 0 and top_p 1 filter nothing)."""
    return {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
            "seed": params.seed, "ignore_eos": params.ignore_eos}


class VLLMEngine(Engine):
    """vLLM behind the engine interface; ``version`` says which build ran (for the results)."""

    name = VLLM
    chapter = "11"
    summary = "vLLM, the peer: its own venv (make peers) and process"

    def __init__(self, lm: LoadedModel, *, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None,
                 kv_cache_gib: int = DEFAULT_KV_CACHE_GIB, enforce_eager: bool = False,
                 in_process: bool = True,
                 install: PeerInstall | None = None) -> None:
        super().__init__(lm)
        self.install = install or find_vllm()
        # What ran, for the results: the build, and where its engine core ran. vLLM's default
        # puts the engine core in a process of its own; on our 2-core CPU that cost it
        # 1.5-1.6x (batch 1 and 8, and chapter 08's workload: 21 vs 31, 115 vs 178 and 127 vs
        # 201 tok/s, one run kept in the note, not as a CSV), the two processes
        # contending for the cores. In-process
        # (VLLM_ENABLE_V1_MULTIPROCESSING=0, which the driver's --in-process sets) is the
        # faster peer here, so it is the default; in_process=False measures vLLM's own.
        self.version = f"{self.install.label} (engine core in-process)" if in_process \
            else self.install.label
        if lm.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise InvalidRequestError(f"vLLM runs float32, bfloat16 or float16, not {lm.dtype}")
        model_dir, self._model_tmp = peer_model_dir(lm)
        args = ["--model", str(model_dir), "--served-model-name", lm.name,
                "--dtype", str(lm.dtype).removeprefix("torch.")]
        if max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if max_num_seqs is not None:
            args += ["--max-num-seqs", str(max_num_seqs)]
        if enforce_eager:
            args.append("--enforce-eager")
        if in_process:  # its engine core in the driver's process (and a profile sees it)
            args.append("--in-process")
        self.process = PeerProcess(self.install.python, DRIVER, args, peer_env(kv_cache_gib))
        self.engine_config = {k: v for k, v in self.process.ready.items() if k != "ready"}

    def run(self, requests: list[dict[str, Any]], params: SamplingParams, warmup: int = 0,
            repeat: int = 1, reset_prefix_cache: bool = True) -> list[dict[str, Any]]:
        """The driver's runs of one job (see :mod:`.vllm_driver` for the format)."""
        return self.process.ask({"requests": requests, "sampling": _sampling(params),
                                 "warmup": warmup, "repeat": repeat,
                                 "reset_prefix_cache": reset_prefix_cache})["runs"]

    def profile(self, requests: list[dict[str, Any]], params: SamplingParams,
                warmup: int = 1) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One run of ``requests`` under torch.profiler, after ``warmup`` plain ones: the run
        and its ops by self time (vLLM's model ops only for an engine built ``in_process``)."""
        answer = self.process.ask({"requests": requests, "sampling": _sampling(params),
                                   "warmup": warmup, "repeat": 1, "profile": True})
        return answer["runs"][0], answer["ops"]

    def profile_steps(self, prompts: list[list[int]], warm_steps: int, steps: int,
                      joiners: list[list[list[int]]] | None = None,
                      profile: bool = True) -> dict[str, Any]:
        """``steps`` steps of the whole batch of ``prompts`` under torch.profiler, ``warm_steps``
        after every prompt had its first token (greedy, one plain run first), ``joiners[k]``
        (new prompts of one token each) added before the ``k``-th of those ``warm_steps +
        steps``: ``{"steps", "wall_s", "step_s", "ops"}``, each step's seconds and the ops by
        self time (see :mod:`.vllm_driver`). Without joiners, decode steps; with ``profile``
        false, the same steps timed with no profiler (``ops`` empty)."""
        # A prompt prefilled in the first chunk decodes while the others prefill, and must not
        # finish before the window ends: room for every chunk of the prompts besides.
        prompt_steps = -(-sum(map(len, prompts)) // self.engine_config["max_num_batched_tokens"])
        requests = [{"prompt_ids": p, "max_tokens": prompt_steps + warm_steps + steps + 2}
                    for p in prompts]
        window = {"warm_steps": warm_steps, "steps": steps, "joiners": joiners,
                  "profile": profile}
        answer = self.process.ask({"requests": requests,
                                   "sampling": _sampling(SamplingParams(ignore_eos=True)),
                                   "warmup": 1, "repeat": 1, "profile_steps": window})
        return answer["runs"][0]["window"]

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        start = time.perf_counter()
        (run,) = self.run([{"prompt_ids": p, "max_tokens": params.max_new_tokens}
                           for p in prompts], params)
        rows = run["requests"]
        steps = batch_token_times(r["token_times_s"] for r in rows)
        return GenerationResult([r["token_ids"] for r in rows], start,
                                [start + t for t in steps], start + run["duration_s"])

    def close(self) -> None:
        self.process.close()
        if self._model_tmp is not None:
            self._model_tmp.cleanup()


@dataclass(frozen=True, slots=True)
class TokenAgreement:
    """One prompt's greedy tokens from vLLM against HF's."""

    prompt: int
    matched: int  # new tokens equal to HF's before the first difference
    total: int
    # At the first difference: |logit(vLLM's token) - logit(HF's token)| / max |logit|, from
    # HF's own forward on the prompt and the common prefix (a near-tie is a few 1e-7 in fp32).
    relative_logit_gap: float | None


def greedy_agreement(lm: LoadedModel, engine: VLLMEngine, prompts: Sequence[Sequence[int]],
                     new_tokens: int) -> list[TokenAgreement]:
    """vLLM's greedy tokens against ``hf``'s, prompt by prompt, EOS ignored."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    theirs = engine.generate(prompts, params).token_ids
    reference = make_engine("hf", lm).generate(prompts, params).token_ids
    agreements = []
    for i, (row, ref) in enumerate(zip(theirs, reference, strict=True)):
        k = next((j for j, (a, b) in enumerate(zip(row, ref, strict=True)) if a != b), None)
        gap = None
        if k is not None:
            with torch.inference_mode():
                ids = torch.tensor([[*prompts[i], *ref[:k]]], device=lm.device)
                logits = lm.model(ids, logits_to_keep=1).logits[0, -1].float()
            gap = float((logits[row[k]] - logits[ref[k]]).abs() / logits.abs().max())
        agreements.append(TokenAgreement(i, len(ref) if k is None else k, len(ref), gap))
    return agreements
