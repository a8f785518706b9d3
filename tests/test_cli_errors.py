"""Every bad input gets one clear line and exit 2, checked before any work is done (issue 13);
Ctrl-C in a benchmark exits 130 with one line and keeps what had finished.

The table runs in-process through ``miniinfer.cli.main`` (fast). Cases marked ``before_load``
must be answered before a model loads: ``load_model`` is replaced by a function that fails the
test. A few cases need a real process: bytes on the command line that are not UTF-8, and
SIGINT."""

from __future__ import annotations

import http.server
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import miniinfer.cli
import miniinfer.core.models
import miniinfer.server.app
from miniinfer import InvalidRequestError, SamplingParams, make_engine
from miniinfer.bench.inputs import MAX_INPUT_BYTES, write_atomically
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
    with (tmp / "huge.jsonl").open("wb") as f:  # sparse: no disk, no time
        f.truncate(MAX_INPUT_BYTES + 1)
    return {name: str(tmp / name) for name in (
        "dir", "regular", "latin1.jsonl", "empty.jsonl", "surrogate.jsonl", "bad-json.jsonl",
        "no-field.jsonl", "number.jsonl", "long.jsonl", "bad-output-len.jsonl",
        "huge.jsonl")} | {
        "missing": str(tmp / "missing.jsonl"), "under-regular": str(tmp / "regular" / "o.csv")}


GEN = ["generate", "--model", "tiny", "--device", "cpu"]
GEN_HI = [*GEN, "--prompt", "hi"]
BENCH = ["bench", "--model", "tiny", "--engines", "naive", "--batch-sizes", "1",
         "--prompt-len", "4", "--new-tokens", "2", "--warmup", "0", "--repeat", "1"]
SERVE = ["bench-serving", "--model", "tiny", "--systems", "continuous", "--num-requests", "2",
         "--prompt-len", "4,8", "--output-len", "2,4", "--no-warmup"]
SERVER = ["serve", "--model", "tiny", "--device", "cpu"]
HUGE = str(10**12)

# (args, distinctive words of the error line, answered before the model loads). "{name}" is
# a file from _files.
CASES = [
    # Issue 92's benchmarks: a format llama.cpp has no file for, a model it does not hold.
    ([*BENCH, "--against-llama-cpp", "int3"], "--against-llama-cpp takes formats among int4, "
     "int8, fp32, got int3", True),
    ([*BENCH, "--against-llama-cpp", "int4"], "--against-llama-cpp runs smollm2-135m", True),
    ([*BENCH, "--kernel-rows", "int2"], "--kernel-rows takes int4 and int8, got int2", True),
    (["bench", "--model", "tiny", "--engines", "hf", "--breakdown"],
     "--breakdown times the steps of chapter 08's engine and the stages built on it; hf runs a "
     "static batch", True),
    ([*BENCH, "--breakdown", "--kernel-rows", "int4"],
     "argument --kernel-rows: not allowed with argument --breakdown", True),
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
    # Inputs that would block or never end (issue 28): a device is not a prompts file.
    ([*GEN, "--prompts", "/dev/zero"], "/dev/zero is not a regular file", True),
    ([*SERVE, "--dataset", "/dev/urandom"], "/dev/urandom is not a regular file", True),
    ([*GEN, "--prompts", "{huge.jsonl}"], "is larger than 1024 MiB", True),
    # Absurd sizes: refused before anything that big is made.
    ([*BENCH, "--batch-sizes", "1,100000000"], "--batch-sizes 100000000 is more than 4,096",
     True),
    ([*SERVE, "--num-requests", "1000000000"], "--num-requests 1000000000 is more than 100,000",
     True),
    ([*BENCH, "--new-tokens", HUGE], "more than the model's context of 512", False),
    ([*SERVE, "--prompt-len", f"4,{HUGE}"], "--prompt-len at its highest", False),
    ([*SERVE, "--output-len", f"2,{HUGE}"], "--output-len at its highest", False),
    ([*SERVE, "--workload", "shared-prefix", "--shared-prefix-len", HUGE],
     "--shared-prefix-len with the shortest question and answer", False),
    ([*SERVE, "--workload", "multi-turn", "--turns", "100000", "--num-requests", "100000"],
     "--turns 100000: the last turn at its shortest", False),
    ([*SERVER, "--kv-cache-bytes", "0"], "--kv-cache-bytes must be >= 1", True),
    ([*SERVER, "--kv-cache-bytes", str(10**18)], "bytes of memory the cpu device has", True),
    # Where the server cannot listen, and a --base-url that is no server's.
    ([*SERVER, "--host", "192.0.2.1"], "--host 192.0.2.1 is not an address of this machine",
     True),
    ([*SERVER, "--host", "no-such-host.invalid"], "is not a name or address this machine can",
     True),
    ([*SERVER, "--port", "70000"], "port must be in 0-65535", True),
    ([*SERVE, "--base-url", "localhost:8000"], "is not an http(s) URL", True),
    ([*SERVE, "--base-url", "http://127.0.0.1:99999/v1"], "is not an http(s) URL", True),
    ([*SERVE, "--base-url", "ftp://127.0.0.1/v1"], "is not an http(s) URL", True),
    # argparse's own errors: usage first, the error line last.
    ([*GEN, "--max-new-tokens", "x"], "invalid int value: 'x'", True),
    (["bench", "--batch-sizes", "1,x"], "expected comma-separated integers", True),
]


@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(miniinfer.core.models, "load_model", fail)
    monkeypatch.setattr(miniinfer.server.app, "load_model", fail)  # imported by name there


@pytest.mark.parametrize(("args", "message", "before_load"), CASES,
                         ids=[f"{i:02d}-{' '.join(c[0])[:60]}" for i, c in enumerate(CASES)])
def test_bad_input_exits_2_with_one_line(args, message, before_load, tmp_path, request, capsys):
    if before_load:
        request.getfixturevalue("no_model_load")
    files = _files(tmp_path)
    args = [files[a[1:-1]] if a.startswith("{") and a.endswith("}") else a for a in args]
    try:
        status = main(args)
    except SystemExit as exc:  # argparse's errors
        status = exc.code
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


def _error_line(status: int, capsys) -> str:
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("miniinfer: error: "), err
    return lines[0]


def test_a_fifo_as_prompts_file_is_refused_without_opening_it(tmp_path, no_model_load, capsys):
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    done = threading.Event()

    def writer() -> None:
        """Opening a FIFO to read blocks until someone opens it to write: this thread does as
        soon as a reader waits (a non-blocking open fails while there is none), so a regression
        reads an empty file and fails the test instead of hanging it."""
        while not done.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                return
            except OSError:  # ENXIO: no reader yet
                done.wait(0.01)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        line = _error_line(main([*GEN, "--prompts", str(fifo)]), capsys)
    finally:
        done.set()
        thread.join()
    assert f"prompts file {fifo} is not a regular file" in line


def test_a_port_in_use_is_found_before_the_model_loads(no_model_load, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        line = _error_line(main([*SERVER, "--port", str(port)]), capsys)
    assert f"port {port} is in use on 127.0.0.1" in line


def test_a_base_url_where_nothing_listens(no_model_load, capsys):
    # A bound socket that does not listen: connections to its port are refused.
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/v1"
        line = _error_line(main([*SERVE, "--base-url", url]), capsys)
    assert f"no server answers at --base-url {url}" in line


def test_a_base_url_that_is_not_an_openai_server(no_model_load, capsys):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:  # the error line must be stderr's only line
            pass

    # Any HTTP server that has no /v1/models: here, Python's own file server.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/nothing-here/v1"
        line = _error_line(main([*SERVE, "--base-url", url]), capsys)
    finally:
        server.shutdown()
        thread.join()
    assert "answered HTTP 404, not an OpenAI-compatible /v1 server's list of models" in line


def test_results_are_written_whole_or_not_at_all(tmp_path):
    out = tmp_path / "new" / "results.csv"
    write_atomically(out, lambda path: path.write_text("a,b\n1,2\n"))
    assert out.read_text() == "a,b\n1,2\n" and os.listdir(out.parent) == ["results.csv"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())

    def fails_halfway(path: Path) -> None:
        path.write_text("a,b\n3,")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(out, fails_halfway)
    # The old results are still there, whole, and no temporary file is left behind.
    assert out.read_text() == "a,b\n1,2\n" and os.listdir(out.parent) == ["results.csv"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_bench_writes_its_csv_through_a_temporary_file(tmp_path, monkeypatch, capsys):
    written = []
    real = miniinfer.cli.write_atomically

    def spy(path, write):
        written.append(path)
        real(path, write)

    monkeypatch.setattr(miniinfer.cli, "write_atomically", spy)
    out = tmp_path / "bench.csv"
    assert main([*BENCH, "--out", str(out)]) == 0
    assert written == [out] and os.listdir(tmp_path) == ["bench.csv"]
    assert pd.read_csv(out).batch_size.tolist() == [1]


@pytest.mark.parametrize("prompts, message", [
    ("abc", "prompts must be a list of prompts, each a list of integer token ids, got str"),
    ([[5, 6], "abc"], "prompt 1 must be a list of integer token ids, got str"),
    ([7, 8], "prompt 0 must be a list of integer token ids, got int"),
    ([[5, True]], r"prompt 0: token 1 is True \(bool\), not an integer token id"),
    ([[5, np.bool_(False)]], r"prompt 0: token 1 is np.False_ \(bool\)"),
    ([[5, 6.0]], r"token 1 is 6.0 \(float\)"),
    ([[5, None]], r"token 1 is None \(NoneType\)"),
    ([[5, torch.tensor(0.5)]], r"token 1 is tensor\(0.5000\) \(Tensor\)"),
    ([[]], "prompt 0 is empty"),
    ([], "no prompts given"),
    ([[5, 10**6]], r"prompt 0 has token ids outside \[0, 49152\)"),
])
@pytest.mark.parametrize("stage", ["naive", "continuous"])
def test_generate_checks_its_prompts(stage, prompts, message, tiny):
    with pytest.raises(InvalidRequestError, match=message):
        make_engine(stage, tiny).generate(prompts, SamplingParams(max_new_tokens=1))


@pytest.mark.parametrize("params", [{"max_new_tokens": 2}, 3, "greedy", False])
def test_generate_checks_its_params(params, tiny):
    with pytest.raises(InvalidRequestError, match="params must be a SamplingParams"):
        make_engine("naive", tiny).generate([[5, 6]], params)


def test_generate_takes_integers_of_any_kind(tiny):
    engine = make_engine("naive", tiny)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    expected = engine.generate([[5, 6, 7]], params).token_ids
    for prompts in (np.array([[5, 6, 7]]), [[np.int64(5), np.int32(6), torch.tensor(7)]],
                    ((5, 6, 7),), torch.tensor([[5, 6, 7]])):
        assert engine.generate(prompts, params).token_ids == expected


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


def _interrupt_once(args: list[str], progress: str) -> tuple[int, str, str]:
    """Run the CLI, send SIGINT once stderr shows ``progress`` (tqdm's count), and return the
    exit status, stdout and stderr. The generous limits only turn a hang into a failure."""
    proc = subprocess.Popen(_cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = b""
    deadline = time.monotonic() + 600
    while progress.encode() not in err:
        assert proc.poll() is None and time.monotonic() < deadline, err.decode()
        readable, _, _ = select.select([proc.stderr], [], [], 1.0)
        if readable:
            err += os.read(proc.stderr.fileno(), 65536)
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=600)
    return proc.returncode, out.decode(), (err + (rest or b"")).decode()


def _run_with_bytes(*args: str | bytes) -> subprocess.CompletedProcess:
    return subprocess.run(_cli(*args), capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def processes(tmp_path_factory) -> dict[str, object]:
    """The real processes, run side by side (most of each is Python's start-up). Each is
    interrupted once its progress bar says that the first part has finished, during a second
    part that cannot finish first, whatever the load on the machine:
    - bench: batch sizes 1 and 2 have run (tqdm shows 2/3; a batch size's row is kept just
      after the bar moves, so 1 is surely kept and 2 may be), then SIGINT lands in the main
      thread before batch size 64 has decoded its 500 tokens;
    - serving: the run at rate inf finishes (1/2), then SIGINT lands in the worker thread
      during the next, whose 16 arrivals at 0.001 per second would take hours: the process
      exiting at all shows that Ctrl-C does not wait for a run to end;
    - bytes: a prompt of bytes that are not UTF-8."""
    tmp = tmp_path_factory.mktemp("processes")
    with ThreadPoolExecutor(max_workers=3) as pool:
        jobs = {
            "bench": pool.submit(_interrupt_once, [
                "bench", "--model", "tiny", "--engines", "naive", "--batch-sizes", "1,2,64",
                "--prompt-len", "8", "--new-tokens", "500", "--warmup", "0", "--repeat", "1",
                "--out", str(tmp / "bench.csv")], "2/3"),
            "serving": pool.submit(_interrupt_once, [
                "bench-serving", "--model", "tiny", "--systems", "continuous",
                "--request-rates", "inf,0.001", "--num-requests", "16", "--prompt-len", "8,16",
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
    status, stdout, stderr = processes["bench"]
    assert status == 130 and "Traceback" not in stderr
    df = pd.read_csv(out)
    assert df.batch_size.tolist() in ([1], [1, 2]) and df.partial.all() and "naive" in stdout
    rows = "1 finished row" if len(df) == 1 else "2 finished rows"
    assert stderr.strip().splitlines()[-1] == (
        f"miniinfer: interrupted; wrote the {rows} to {out}, marked partial=True")


def test_ctrl_c_in_bench_serving_keeps_the_finished_runs(processes):
    out = processes["dir"] / "serving.csv"
    status, stdout, stderr = processes["serving"]
    assert status == 130 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"miniinfer: interrupted; wrote the 1 finished row to {out}, marked partial=True")
    runs = pd.read_csv(out)
    requests = pd.read_csv(out.with_name("serving-requests.csv"))
    assert runs.request_rate.tolist() == [float("inf")] and runs.partial.all()
    assert len(requests) == 16 and requests.partial.all() and "continuous" in stdout


def test_ctrl_c_before_anything_finished_writes_nothing(tmp_path, monkeypatch, capsys):
    """In-process: SIGINT reaches the main thread during the third step of the first run,
    which the engine takes in the worker thread. That step then waits for the interrupt to
    come back to it (the main thread raises it in the worker), so exactly three steps run
    however slowly the main thread gets to it."""
    out = tmp_path / "serving.csv"
    step = ContinuousEngine.step
    steps = []

    def step_then_interrupt(self):
        steps.append(None)
        if len(steps) == 3:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            deadline = time.monotonic() + 600  # only turns a lost interrupt into a failure
            while time.monotonic() < deadline:
                time.sleep(0.01)  # Python bytecode between sleeps: where the interrupt lands
            raise AssertionError("Ctrl-C never reached the worker thread")
        return step(self)

    monkeypatch.setattr(ContinuousEngine, "step", step_then_interrupt)
    assert main([*SERVE, "--output-len", "400,400", "--out", str(out)]) == 130
    assert len(steps) == 3
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "miniinfer: interrupted before any result had finished; nothing was written")
    assert not out.exists()


def _ctrl_c_while_the_main_thread_waits(executor: ThreadPoolExecutor,
                                       before=lambda: None) -> None:
    """Every call submitted to ``executor`` from now on raises KeyboardInterrupt in the main
    thread while it waits for the result (after ``before()``), as Ctrl-C there would."""
    submit = executor.submit

    def ctrl_c_while_waiting(timeout=None):
        before()
        raise KeyboardInterrupt

    def submit_then_interrupt(*args):
        future = submit(*args)
        future.result = ctrl_c_while_waiting
        return future

    executor.submit = submit_then_interrupt


def test_ctrl_c_before_the_worker_starts_a_run_cancels_it():
    """Ctrl-C while the main thread waits for a run that the worker thread has not started
    yet: the run must not start (the main thread would wait for all of it). The worker is
    held until the main thread has handled the interrupt, so the order is certain."""
    from miniinfer.bench.serving.benchmark import _Worker

    handled = threading.Event()

    class LockThatTells:
        """The worker's lock; the main thread's handling of Ctrl-C ends by releasing it."""

        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __enter__(self) -> None:
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()
            if threading.current_thread() is threading.main_thread():
                handled.set()

    calls = []
    with ThreadPoolExecutor(max_workers=1) as executor:
        executor.submit(handled.wait, 600)  # keeps the one worker thread busy until then
        worker = _Worker(executor)
        worker.lock = LockThatTells()
        _ctrl_c_while_the_main_thread_waits(executor)
        with pytest.raises(KeyboardInterrupt):
            worker.run(calls.append, "the run")
    assert handled.is_set() and calls == []


def test_ctrl_c_stops_a_run_whose_worker_lost_the_first_interrupt():
    """The interrupt raised in the worker thread can be lost there (one that lands while the
    worker runs a finalizer is only printed): the main thread raises it again until the run
    has ended, instead of waiting for the whole run (hours, in the CLI test above)."""
    from miniinfer.bench.serving.benchmark import _Worker

    started, interrupts = threading.Event(), []

    def run_that_loses_the_first_interrupt() -> None:
        started.set()
        gives_up = time.monotonic() + 60  # without a second interrupt: ends, and the test fails
        while time.monotonic() < gives_up:
            try:
                while time.monotonic() < gives_up:
                    time.sleep(0.01)
            except KeyboardInterrupt:
                interrupts.append(time.monotonic())
                if len(interrupts) > 1:
                    raise

    with ThreadPoolExecutor(max_workers=1) as executor:
        worker = _Worker(executor)
        _ctrl_c_while_the_main_thread_waits(executor, before=lambda: started.wait(600))
        with pytest.raises(KeyboardInterrupt):
            worker.run(run_that_loses_the_first_interrupt)
    assert len(interrupts) == 2 and worker.busy_thread is None


def test_ctrl_c_inside_the_submit_stops_the_run_the_worker_has_started():
    """Ctrl-C can land in the main thread inside ``executor.submit``, after the worker has
    started the call and before the future is returned: the run must still be interrupted and
    ended before the main thread goes on (else the executor waits for all of it; a CI run's
    bench-serving went on for the 10 minutes its test allows)."""
    from miniinfer.bench.serving.benchmark import _Worker

    started, released, ended = threading.Event(), threading.Event(), []

    def long_run() -> None:
        started.set()
        try:
            while not released.wait(0.01):  # ends when interrupted (or when the test gives up)
                pass
        finally:
            ended.append("released" if released.is_set() else "interrupted")

    class SubmitThatIsInterrupted:
        def __init__(self, executor: ThreadPoolExecutor) -> None:
            self.executor = executor

        def submit(self, *args):
            self.executor.submit(*args)
            assert started.wait(600)
            raise KeyboardInterrupt  # as SIGINT would, before submit returns the future

    with ThreadPoolExecutor(max_workers=1) as executor:
        worker = _Worker(SubmitThatIsInterrupted(executor))
        with pytest.raises(KeyboardInterrupt):
            worker.run(long_run)
        after_run = (list(ended), worker.busy_thread)
        released.set()
    assert after_run == (["interrupted"], None)


@pytest.mark.parametrize("command", [BENCH, SERVE])
def test_ctrl_c_while_the_model_loads(command, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(miniinfer.core.models, "load_model", interrupted)
    assert main([*command, "--out", str(tmp_path / "x.csv")]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "miniinfer: interrupted before any result had finished; nothing was written"]
    assert not list(tmp_path.iterdir())
