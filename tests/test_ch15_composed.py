"""Chapter 15's stage, ``composed``: every setting that pays on the device at once, each still
removable by name; its greedy tokens equal its own int4 stage's without drafts."""

from __future__ import annotations

import pytest
import torch
from template import first_difference

from miniinfer import SamplingParams, make_engine
from miniinfer.core.config import EngineConfig
from miniinfer.engines import ENGINES, engine_config
from miniinfer.engines.composed import GPU_SETTINGS, ComposedEngine
from miniinfer.engines.continuous import ContinuousEngine
from miniinfer.engines.speculative import SpeculativeEngine


def test_the_preset_is_every_optimisation_that_pays_on_a_cpu():
    assert ENGINES["composed"] is ComposedEngine
    assert engine_config("composed") == EngineConfig(
        weights="int4", forward="compiled", prefix_caching=True, chunked_prefill=True,
        speculative="ngram", draft_policy="adaptive")
    # On a GPU its own best instead; a CPU keeps the preset.
    assert ComposedEngine.device_settings(torch.device("cuda")) == GPU_SETTINGS
    assert GPU_SETTINGS["weights"] == "dense" and GPU_SETTINGS["cuda_graphs"]
    assert ComposedEngine.device_settings(torch.device("cpu")) == {}
    assert ContinuousEngine.device_settings(torch.device("cuda")) == {}


def test_each_optimisation_comes_off_by_name(tiny):
    """What chapter 15's ablation builds: the preset with one setting removed."""
    engine = make_engine("composed", tiny, weights="int8", forward="direct", speculative=None)
    # Without drafts it is chapter 08's engine class, the rest of the preset kept.
    assert type(engine) is ContinuousEngine
    assert engine.config.prefix_caching and engine.runner.weights == "int8"
    assert engine.runner.forward_name == "direct"
    engine = make_engine("composed", tiny, weights="int8", forward="direct",
                         prefix_caching=False)
    assert isinstance(engine, SpeculativeEngine) and not engine.config.prefix_caching


def test_greedy_tokens_equal_its_own_int4_stage_without_drafts_on_smollm2(smollm2):
    """On chapter 14's prompts (input-grounded and open-ended), eagerly here: the compiled
    forward's verification is tested in chapter 11's and 14's tests, and chapter 15's recording
    checks the preset as served."""
    from miniinfer.core.models import chat_text
    from miniinfer.lab.speculation import OPEN_ENDED, TEXT, input_grounded_tasks

    tasks = input_grounded_tasks(TEXT.read_text())
    texts = [tasks["copy"][1], tasks["rewrite"][0], OPEN_ENDED[1]]
    tok = smollm2.tokenizer
    prompts = [tok.encode(chat_text(tok, [{"role": "user", "content": t}]),
                          add_special_tokens=False) for t in texts]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    eager = {"forward": "direct"}
    plain = make_engine("composed", smollm2, speculative=None, **eager)
    composed = make_engine("composed", smollm2, **eager)
    assert composed.runner.weights == "int4"
    for prompt in prompts:
        expected = plain.generate([prompt], params).token_ids[0]
        ours = composed.generate([prompt], params).token_ids[0]
        assert ours == expected, first_difference(ours, expected)
    assert composed.stats.accepted > 0, "the quoting prompt's drafts were kept"
    assert composed.kv_cache.block_manager.block_tables == {}


def test_serve_engine_composed_runs_the_preset_and_refuses_what_cannot_combine():
    from miniinfer.core.errors import InvalidRequestError
    from miniinfer.server import ServerConfig

    config = ServerConfig(engine="composed")
    assert engine_config(config.engine, **config.engine_options()) == EngineConfig(
        weights="int4", forward="compiled", prefix_caching=True, speculative="ngram",
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
    with pytest.raises(InvalidRequestError, match="forward='compiled' and tensor_parallel=2"):
        ServerConfig(engine="composed", tensor_parallel=2)


def test_the_ablation_removes_one_optimisation_at_a_time_on_shared_runners(tiny, monkeypatch):
    from miniinfer.lab import deploy

    built = []
    original = deploy.make_engine

    def counting(*args, **kwargs):
        engine = original(*args, **kwargs)
        built.append((engine, "runner" in kwargs))
        return engine

    monkeypatch.setattr(deploy, "make_engine", counting)
    config = deploy.DeployConfig(new_tokens=4, ablation_clients=2, ablation_repeats=1,
                                 base_settings=(("weights", "int8"), ("forward", "direct")))
    prompts = {"chat": [[5, 6, 7, 8, 9] * 3, [5, 6, 7, 10]], "grounded": [[11, 12, 13] * 4]}
    rows = deploy.ablation_rows(tiny, config, prompts)
    assert [(r["system"], r["workload"]) for r in rows] == [
        (name, w) for w in config.ablation_workloads for name in deploy.ABLATION]
    assert all(r["output_throughput_min"] <= r["output_throughput"]
               <= r["output_throughput_max"] and r["repeats"] == 1 for r in rows)
    engines = {e.config.speculative: e for e, _ in built}
    assert engines[None].runner is built[0][0].runner, "- speculation reuses the runner"
    configs = {name: e.config for name, (e, _) in zip(deploy.ABLATION, built, strict=True)}
    assert configs["- int4 (fp32 weights)"].weights == "dense"
    assert not configs["- prefix caching"].prefix_caching
    assert configs["- speculation"].speculative is None
    assert all(c.weights == "int8" for n, c in configs.items() if n != "- int4 (fp32 weights)")
    # Every request finished and gave its blocks back.
    assert all(e.kv_cache.block_manager.block_tables == {} for e, _ in built)


def test_a_closed_loop_keeps_at_most_its_clients_in_flight(tiny):
    from miniinfer.lab.deploy import _closed_loop

    engine = make_engine("continuous", tiny)
    running = []
    step = engine.step

    def counted():
        running.append(len(engine.scheduler.running))
        return step()

    engine.step = counted
    rate = _closed_loop(engine, [[5, 6, 7, 8]] * 7, 3, SamplingParams(max_new_tokens=5,
                                                                       ignore_eos=True))
    assert rate > 0 and max(running) == 3 and not engine.has_unfinished_requests()


def test_a_peer_not_built_is_skipped_with_one_line(tiny, tmp_path, monkeypatch):
    from miniinfer.bench.peers import PEERS_VENV_ENV
    from miniinfer.lab import deploy

    monkeypatch.setenv(PEERS_VENV_ENV, str(tmp_path))
    lines = []
    rows = deploy.served_rows(tiny, deploy.DeployConfig(systems=("llama-server", "vllm")),
                              {"chat": [[5, 6, 7]]}, log=lines.append)
    assert rows == [] and len(lines) == 2
    assert lines[0].startswith("llama-server: skipped (") and "make peers-llama" in lines[0]
    assert lines[1].startswith("vllm: skipped (")


def test_a_served_row_is_the_median_run_with_the_range_of_all():
    from miniinfer.lab.deploy import median_run

    runs = [{"output_throughput": 90.0, "ttft_p50_ms": 1.0},
            {"output_throughput": 70.0, "ttft_p50_ms": 2.0},
            {"output_throughput": 80.0, "ttft_p50_ms": 3.0}]
    assert median_run(runs) == {"output_throughput": 80.0, "ttft_p50_ms": 3.0,
                                "output_throughput_min": 70.0, "output_throughput_max": 90.0,
                                "repeats": 3}
    # Two runs: the slower one, so a system is never credited with its best run alone.
    assert median_run(runs[:2])["output_throughput"] == 70.0


def test_a_servers_peak_memory_counts_the_processes_it_started():
    import subprocess
    import sys
    import time

    from miniinfer.lab.deploy import peak_rss_mib

    # A parent holding a child that allocates 64 MiB: the parent's own peak does not hold it.
    code = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', "
            "\"b = bytearray(64 << 20); import sys; sys.stdin.read()\"], stdin=subprocess.PIPE); "
            "print('ready', flush=True); sys.stdin.read(); child.kill()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        own = float(next(line.split()[1] for line in
                         open(f"/proc/{parent.pid}/status") if line.startswith("VmHWM:"))) / 1024
        deadline = time.monotonic() + 30
        while peak_rss_mib(parent.pid) < own + 64 and time.monotonic() < deadline:
            time.sleep(0.01)  # polled: the child may still be allocating
        assert peak_rss_mib(parent.pid) >= own + 64
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)
