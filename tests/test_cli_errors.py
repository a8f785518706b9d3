"""Every bad input gets one clear line and exit 2, checked before any work is done (issue 13);
Ctrl-C in a benchmark exits 130 with one line and keeps what had finished.

The table runs in-process through ``miniinfer.cli.main`` (fast). Cases marked ``before_load``
must be answered before a model loads: ``load_model`` is replaced by a function that fails the
test. A few cases need a real process: bytes on the command line that are not UTF-8, and
SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
import torch

import miniinfer.core.models
from miniinfer import InvalidRequestError, SamplingParams, make_engine
from miniinfer.cli import main
from miniinfer.engines.continuous import ContinuousEngine

LONG = "word " * 600  # tiny's context is 512 positions


def _files(tmp: Path) -> dict[str, str]:
    """Bad (and one good) input files, referred to by name in the table."""
    (tmp / "dir").mkdir()
    (tmp / "regular").write_text("x")
    (tmp / "latin1.jsonl").write_bytes('"caf\xe9"\n'.encode("latin-1"))
    (tmp / "empty.jsonl").write_text("\n  \n")
    (tmp / "surrogate.jsonl").write_text('{"prompt": "\\ud800"}\n')
    (tmp / "bad-json.jsonl").write_text('"ok"\n{"prompt": \n')
    (tmp / "no-field.jsonl").write_text('{"text": "hi"}\n')
    (tmp / "number.jsonl").write_text("42\n")
    (tmp / "long.jsonl").write_text(f'{{"prompt": "{LONG}", "output_len": 8}}\n')
    (tmp / "bad-output-len.jsonl").write_text('{"prompt": "hi", "output_len": 0}\n')
    return {name: str(tmp / name) for name in (
        "dir", "regular", "latin1.jsonl", "empty.jsonl", "surrogate.jsonl", "bad-json.jsonl",
        "no-field.jsonl", "number.jsonl", "long.jsonl", "bad-output-len.jsonl")} | {
        "missing": str(tmp / "missing.jsonl"), "under-regular": str(tmp / "regular" / "o.csv")}


GEN = ["generate", "--model", "tiny", "--device", "cpu"]
GEN_HI = [*GEN, "--prompt", "hi"]
BENCH = ["bench", "--model", "tiny", "--engines", "naive", "--batch-sizes", "1",
         "--prompt-len", "4", "--new-tokens", "2", "--warmup", "0", "--repeat", "1"]
SERVE = ["bench-serving", "--model", "tiny", "--systems", "continuous", "--num-requests", "2",
         "--prompt-len", "4,8", "--output-len", "2,4", "--no-warmup"]

# (args, distinctive words of the error line, answered before the model loads). "{name}" is
# a file from _files.
CASES = [
    # The cases tests/test_cli.py had first.
    (["generate", "--engine", "turbo", "--prompt", "hi"], "unknown engine 'turbo'", True),
    (["generate", "--model", "llama-99b", "--prompt", "hi"], "unknown model 'llama-99b'", True),
    ([*GEN, "--prompt", "   "], "prompt 0 is empty", True),
    (GEN, "no prompt given", True),
    ([*GEN_HI, "--temperature", "-1"], "temperature must be >= 0", True),
    ([*GEN, "--prompt", LONG], "more than the model's context", False),
    (["bench", "--engines", "hf,warp"], "unknown engine 'warp'", True),
    (["bench", "--engines", "async:turbo"], "unknown engine 'async:turbo'; its variants", True),
    (["repro", "99"], "unknown chapter '99'", True),
    # Input files: missing, a directory, not UTF-8, empty, bad lines.
    ([*GEN, "--prompts", "{missing}"], "does not exist", True),
    ([*GEN, "--prompts", "{dir}"], "is a directory", True),
    ([*GEN, "--prompts", "{latin1.jsonl}"], "is not UTF-8 text", True),
    ([*GEN, "--prompts", "{empty.jsonl}"], "empty.jsonl is empty", True),
    ([*GEN, "--prompts", "{bad-json.jsonl}"], "bad-json.jsonl:2 is not valid JSON", True),
    ([*GEN, "--prompts", "{no-field.jsonl}"], 'has no "prompt" field', True),
    ([*GEN, "--prompts", "{number.jsonl}"], "a prompt must be a string", True),
    ([*SERVE, "--dataset", "{missing}"], "does not exist", True),
    ([*SERVE, "--dataset", "{dir}"], "is a directory", True),
    ([*SERVE, "--dataset", "{latin1.jsonl}"], "is not UTF-8 text", True),
    ([*SERVE, "--dataset", "{empty.jsonl}"], "empty.jsonl is empty", True),
    ([*SERVE, "--dataset", "{bad-output-len.jsonl}"], '"output_len" must be an integer', True),
    # Text the tokenizer cannot take: a lone surrogate from JSON, bytes from argv.
    ([*GEN, "--prompts", "{surrogate.jsonl}"], "lone surrogate U+D800", True),
    ([*SERVE, "--dataset", "{surrogate.jsonl}"], "lone surrogate U+D800", True),
    ([*GEN, "--prompt", "\udcff\udcfebad"], "not UTF-8 arrive this way", True),
    # --out that cannot be written, found before the model loads.
    ([*BENCH, "--out", "/proc/x.csv"], "cannot be written", True),
    ([*BENCH, "--out", "{dir}"], "is a directory", True),
    ([*BENCH, "--out", "{under-regular}"], "is a file, not a directory", True),
    ([*BENCH, "--out", "/sys/x.csv"], "no file can be created in /sys", True),
    ([*BENCH, "--out", ""], "--out name is empty", True),
    ([*SERVE, "--out", "/proc/x.csv"], "cannot be written", True),
    ([*SERVE, "--out", "{dir}"], "is a directory", True),
    ([*SERVE, "--out", "{under-regular}"], "is a file, not a directory", True),
    # Sampling values.
    ([*GEN_HI, "--temperature", "1e-300"], "temperature must be 0 (greedy) or at least", True),
    ([*GEN_HI, "--temperature", "nan"], "temperature must be >= 0", True),
    ([*GEN_HI, "--temperature", "inf"], "temperature must be >= 0 (a finite number)", True),
    ([*GEN_HI, "--seed", str(2**70)], "seed must be an integer in", True),
    ([*GEN_HI, "--top-p", "0"], "top_p must be in (0, 1]", True),
    ([*GEN_HI, "--top-k", "-1"], "top_k must be an integer >= 0", True),
    ([*GEN_HI, "--max-new-tokens", "0"], "max_new_tokens must be >= 1", True),
    # Devices and dtypes.
    ([*GEN_HI, "--device", "mps"], "device 'mps' is not supported; choose auto, cpu", True),
    ([*GEN_HI, "--device", "meta"], "device 'meta' is not supported", True),
    ([*GEN_HI, "--device", "garbage"], "unknown device 'garbage'; choose", True),
    ([*BENCH, "--device", "mps"], "device 'mps' is not supported", True),
    ([*SERVE, "--device", "meta"], "device 'meta' is not supported", True),
    ([*GEN_HI, "--dtype", "float8"], "unknown dtype 'float8'", True),
    # Benchmark settings.
    ([*BENCH, "--batch-sizes", "0"], "batch sizes >= 1", True),
    ([*BENCH, "--batch-sizes", ""], "need at least one engine and batch sizes", True),
    ([*BENCH, "--engines", ""], "need at least one engine", True),
    ([*BENCH, "--warmup", "-1"], "warmup must be >= 0", True),
    ([*BENCH, "--repeat", "0"], "repeat must be >= 1", True),
    ([*BENCH, "--prompt-len", "600"], "more than the model's context", False),
    ([*SERVE, "--request-rates", "fast"], "expected comma-separated request rates", True),
    ([*SERVE, "--request-rates", "nan"], "request_rate must be > 0", True),
    ([*SERVE, "--num-requests", "0"], "num_requests must be >= 1", True),
    ([*SERVE, "--prompt-len", "5"], "--prompt-len: expected a range", True),
    ([*SERVE, "--output-len", "9,3"], "output_len must be a range", True),
    ([*SERVE, "--systems", "static-warp"], "unknown serving system 'static-warp'", True),
    ([*SERVE, "--max-num-batched-tokens", "0"], "must be >= 1", True),
    ([*SERVE, "--static-batch-size", "0"], "static_batch_size must be >= 1", True),
    ([*SERVE, "--systems", ""], "need at least one system", True),
    # The workload against the model's context, the same answer for every system.
    ([*SERVE, "--prompt-len", "600,600"], "more than the model's context of 512", False),
    ([*SERVE, "--systems", "hf-cb", "--prompt-len", "600,600"],
     "more than the model's context of 512", False),
    ([*SERVE, "--systems", "static-naive", "--dataset", "{long.jsonl}"],
     "more than the model's context of 512", False),
    ([*SERVE, "--systems", "hf-cb", "--dataset", "{long.jsonl}"],
     "more than the model's context of 512", False),
    # Nits.
    (["repro", ""], "unknown chapter ''", True),
    (["repro", "abc"], "unknown chapter 'abc'", True),
    # argparse's own errors: usage first, the error line last.
    ([*GEN, "--max-new-tokens", "x"], "invalid int value: 'x'", True),
    (["bench", "--batch-sizes", "1,x"], "expected comma-separated integers", True),
]


@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(miniinfer.core.models, "load_model", fail)


@pytest.mark.parametrize(("args", "message", "before_load"), CASES,
                         ids=[f"{i:02d}-{' '.join(c[0])[:60]}" for i, c in enumerate(CASES)])
def test_bad_input_exits_2_with_one_line(args, message, before_load, tmp_path, request, capsys):
    if before_load:
        request.getfixturevalue("no_model_load")
    files = _files(tmp_path)
    args = [files[a[1:-1]] if a.startswith("{") and a.endswith("}") else a for a in args]
    start = time.perf_counter()
    try:
        status = main(args)
    except SystemExit as exc:  # argparse's errors
        status = exc.code
    assert time.perf_counter() - start < 30
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines and "error:" in lines[-1] and message in lines[-1], err
    if "usage:" not in err:  # our own errors: nothing but the one line
        assert len(lines) == 1 and lines[0].startswith("miniinfer: error: "), err


def test_cuda_index_beyond_the_devices_there_are(monkeypatch, no_model_load, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main([*GEN_HI, "--device", "cuda:7"]) == 2
    assert "device 'cuda:7' does not exist: this machine has 1 CUDA device" in \
        capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
def test_cuda_without_cuda(no_model_load, capsys):
    assert main([*GEN_HI, "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_out_in_a_read_only_directory(tmp_path, no_model_load, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main([*BENCH, "--out", str(locked / "x.csv")]) == 2
    assert "no file can be created" in capsys.readouterr().err


def test_bom_is_tolerated(tmp_path, capsys):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf"One"\n')
    assert main([*GEN, "--prompts", str(path), "--max-new-tokens", "1", "--json"]) == 0
    assert '"prompt": "One"' in capsys.readouterr().out


@pytest.fixture(scope="module")
def continuous(tiny):
    return make_engine("continuous", tiny)


@pytest.mark.parametrize("kwargs", [
    {"request_id": ["x"]}, {"request_id": ("a", [1])}, {"stop": None}, {"stop": "end"},
    {"params": {"max_new_tokens": 3}}, {"arrival_time": "now"},
])
def test_add_request_rejects_bad_arguments(kwargs, continuous):
    engine = continuous
    with pytest.raises(InvalidRequestError):
        engine.add_request([5, 6, 7], **kwargs)
    with pytest.raises(InvalidRequestError, match="integer token ids"):
        engine.add_request(["a", "b"])
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1e-3}, {"temperature": "0.5"}, {"temperature": True}, {"seed": 2**64},
    {"seed": -(2**63) - 1}, {"seed": 1.5}, {"max_new_tokens": 2.0}, {"ignore_eos": "yes"},
    {"top_p": None},
])
def test_sampling_params_reject_types_and_ranges(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_sampling_params_take_the_edges_of_their_ranges():
    for seed in (-(2**63), 2**64 - 1):
        torch.Generator().manual_seed(SamplingParams(temperature=0.01, seed=seed).seed)


def _cli(*args: str | bytes) -> list[str | bytes]:
    return [sys.executable, "-m", "miniinfer", *args]


def _interrupt_once(args: list[str], progress: str) -> tuple[int, str, str, float]:
    """Run the CLI, send SIGINT once stderr shows ``progress`` (tqdm's count), and return the
    exit status, stdout, stderr and the seconds from the signal to the exit."""
    proc = subprocess.Popen(_cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.set_blocking(proc.stderr.fileno(), False)
    err = b""
    deadline = time.monotonic() + 240
    while progress.encode() not in err:
        assert proc.poll() is None and time.monotonic() < deadline, err.decode()
        time.sleep(0.05)
        err += proc.stderr.read() or b""
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    out, rest = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    return proc.returncode, out.decode(), (err + (rest or b"")).decode(), took


def _run_with_bytes(*args: str | bytes) -> subprocess.CompletedProcess:
    return subprocess.run(_cli(*args), capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def processes(tmp_path_factory) -> dict[str, object]:
    """The real processes, run side by side (most of each is Python's start-up):
    - bench: batch size 1 finishes (tqdm shows 1/2), then SIGINT lands while batch size 8
      decodes, in the main thread;
    - serving: the run at rate inf finishes (1/2), then SIGINT lands in the worker thread
      during the next, whose arrivals alone take seconds;
    - bytes: a prompt of bytes that are not UTF-8."""
    tmp = tmp_path_factory.mktemp("processes")
    with ThreadPoolExecutor(max_workers=3) as pool:
        jobs = {
            "bench": pool.submit(_interrupt_once, [
                "bench", "--model", "tiny", "--engines", "naive", "--batch-sizes", "1,8",
                "--prompt-len", "8", "--new-tokens", "400", "--warmup", "0", "--repeat", "1",
                "--out", str(tmp / "bench.csv")], "1/2"),
            "serving": pool.submit(_interrupt_once, [
                "bench-serving", "--model", "tiny", "--systems", "continuous",
                "--request-rates", "inf,2", "--num-requests", "16", "--prompt-len", "8,16",
                "--output-len", "50,50", "--no-warmup", "--out", str(tmp / "serving.csv")],
                "1/2"),
            "bytes": pool.submit(_run_with_bytes, *GEN, "--prompt", b"\xff\xfebad"),
        }
        return {"dir": tmp} | {name: job.result() for name, job in jobs.items()}


def test_bytes_on_the_command_line_that_are_not_utf8(processes):
    proc = processes["bytes"]
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "miniinfer: error: --prompt 0 is not valid Unicode text: character 0 is a lone "
        "surrogate U+DCFF (bytes on the command line that are not UTF-8 arrive this way)"]


def test_ctrl_c_in_bench_keeps_the_finished_batch_sizes(processes):
    out = processes["dir"] / "bench.csv"
    status, stdout, stderr, took = processes["bench"]
    assert status == 130 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"miniinfer: interrupted; wrote the 1 finished row to {out}, marked partial=True")
    assert took < 20
    df = pd.read_csv(out)
    assert df.batch_size.tolist() == [1] and df.partial.all() and "naive" in stdout


def test_ctrl_c_in_bench_serving_keeps_the_finished_runs(processes):
    out = processes["dir"] / "serving.csv"
    status, stdout, stderr, took = processes["serving"]
    assert status == 130 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"miniinfer: interrupted; wrote the 1 finished row to {out}, marked partial=True")
    assert took < 20
    runs = pd.read_csv(out)
    requests = pd.read_csv(out.with_name("serving-requests.csv"))
    assert runs.request_rate.tolist() == [float("inf")] and runs.partial.all()
    assert len(requests) == 16 and requests.partial.all() and "continuous" in stdout


def test_ctrl_c_before_anything_finished_writes_nothing(tmp_path, monkeypatch, capsys):
    """In-process: SIGINT reaches the main thread during the third step of the first run,
    which the engine takes in the worker thread."""
    out = tmp_path / "serving.csv"
    step = ContinuousEngine.step
    steps = []

    def step_then_interrupt(self):
        steps.append(None)
        if len(steps) == 3:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return step(self)

    monkeypatch.setattr(ContinuousEngine, "step", step_then_interrupt)
    start = time.perf_counter()
    assert main([*SERVE, "--output-len", "400,400", "--out", str(out)]) == 130
    assert time.perf_counter() - start < 20 and len(steps) < 20
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "miniinfer: interrupted before any result had finished; nothing was written")
    assert not out.exists()


@pytest.mark.parametrize("command", [BENCH, SERVE])
def test_ctrl_c_while_the_model_loads(command, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(miniinfer.core.models, "load_model", interrupted)
    assert main([*command, "--out", str(tmp_path / "x.csv")]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "miniinfer: interrupted before any result had finished; nothing was written"]
    assert not list(tmp_path.iterdir())
