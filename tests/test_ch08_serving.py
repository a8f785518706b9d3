"""Chapter 08: seeded workloads, serving metrics with the usual definitions, and the three
systems of bench-serving serving the same requests (on the tiny model: fast, and enough to
check that each system gets and returns exactly the requests of the workload)."""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import pytest
import torch

from miniinfer import InvalidRequestError, UnknownNameError, make_engine
from miniinfer.bench.serving import (
    ServedRequest,
    ServingBenchConfig,
    ServingRun,
    Systems,
    WorkloadConfig,
    default_pool_bytes,
    make_workload,
    median_of_repeats,
    request_table,
    run_serving_bench,
    serve_continuous,
    serve_hf_cb,
    serve_static,
    summarize,
)
from miniinfer.cli import main
from miniinfer.core.scheduler import RequestTimeline
from miniinfer.lab import serving_records


def test_metrics_follow_the_serving_definitions():
    run = ServingRun("x", 100.0, [
        ServedRequest(0, 5, [1, 2, 3], RequestTimeline(100.0, 100.1, [], [100.5, 100.7, 101.1],
                                                       101.1)),
        ServedRequest(1, 7, [4], RequestTimeline(100.2, 100.2, [], [100.4], 100.4)),
    ])
    table = request_table(run)
    assert table.ttft_ms.round(6).tolist() == [500, 200]
    assert table.e2e_ms.round(6).tolist() == [1100, 200]
    assert table.tpot_ms[0] == pytest.approx(300) and math.isnan(table.tpot_ms[1])
    assert table.queue_ms.round(6).tolist() == [100, 0]
    m = summarize(run)
    assert m["duration_s"] == pytest.approx(1.1)
    assert m["request_throughput"] == pytest.approx(2 / 1.1)
    assert m["output_throughput"] == pytest.approx(4 / 1.1) and m["output_tokens"] == 4
    assert m["ttft_mean_ms"] == pytest.approx(350) and m["ttft_p90_ms"] == pytest.approx(470)
    assert m["tpot_mean_ms"] == pytest.approx(300)  # a one-token request has no TPOT
    # ITL pools every request's gaps: 200 and 400 ms.
    assert m["itl_mean_ms"] == pytest.approx(300) and m["itl_p99_ms"] == pytest.approx(398)
    assert m["e2e_p50_ms"] == pytest.approx(650)


def test_workload_is_seeded_poisson_within_the_ranges(tiny):
    config = WorkloadConfig(num_requests=2000, request_rate=4.0, prompt_len=(3, 9),
                            output_len=(2, 5), seed=1)
    workload = make_workload(tiny, config)
    assert workload == make_workload(tiny, config)
    assert workload != make_workload(tiny, WorkloadConfig(**{**_fields(config), "seed": 2}))
    assert all(3 <= len(w.prompt_ids) <= 9 and 2 <= w.max_new_tokens <= 5 for w in workload)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(workload, workload[1:], strict=False)]
    assert min(gaps) >= 0 and sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)
    offline = make_workload(tiny, WorkloadConfig(num_requests=5))
    assert {w.arrival_s for w in offline} == {0.0}


def _fields(config) -> dict:
    return {f: getattr(config, f) for f in config.__slots__}


def test_workload_from_a_dataset_file(tiny, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there", "output_len": 7}\n\n{"prompt": "Bye"}\n')
    workload = make_workload(tiny, WorkloadConfig(num_requests=20, output_len=(2, 3),
                                                  dataset=str(path)))
    hello, bye = tiny.tokenizer.encode("Hello there"), tiny.tokenizer.encode("Bye")
    assert [w.index for w in workload] == list(range(20))
    assert {tuple(w.prompt_ids) for w in workload} == {tuple(hello), tuple(bye)}
    # The line's output_len wins; a line without one draws from the configured range.
    assert {w.max_new_tokens for w in workload if w.prompt_ids == hello} == {7}
    assert {w.max_new_tokens for w in workload if w.prompt_ids == bye} <= {2, 3}
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(InvalidRequestError, match=r'prompts.jsonl:1 needs a non-empty string'):
        make_workload(tiny, WorkloadConfig(dataset=str(path)))
    with pytest.raises(InvalidRequestError, match="does not exist"):
        make_workload(tiny, WorkloadConfig(dataset=str(tmp_path / "missing.jsonl")))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_requests": 0}, "num_requests must be >= 1"),
    ({"request_rate": 0.0}, "request_rate must be > 0"),
    ({"prompt_len": (10, 5)}, "prompt_len must be a range"),
])
def test_workload_config_validation(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        WorkloadConfig(**kwargs)


def test_unknown_system():
    with pytest.raises(UnknownNameError, match="unknown serving system 'static-turbo'"):
        ServingBenchConfig(systems=("static-turbo",))
    with pytest.raises(UnknownNameError, match="static-paged-attention"):
        ServingBenchConfig(systems=("static-continuous",))


def test_three_systems_serve_the_same_requests_with_the_same_tokens(tiny):
    workload = make_workload(tiny, WorkloadConfig(num_requests=6, request_rate=40.0,
                                                  prompt_len=(2, 40), output_len=(1, 9), seed=3))
    runs = [
        serve_continuous(make_engine("continuous", tiny, max_num_batched_tokens=16), workload),
        serve_static(make_engine("paged-attention", tiny), workload, batch_size=4),
        serve_hf_cb(tiny, workload, max_batch_tokens=64, kv_cache_bytes=default_pool_bytes(tiny)),
    ]
    for run in runs:
        assert [r.index for r in run.requests] == list(range(6))
        assert [len(r.output_ids) for r in run.requests] == [w.max_new_tokens for w in workload]
        for r, w in zip(run.requests, workload, strict=True):
            t = r.timeline
            assert len(t.token_times) == w.max_new_tokens and r.prompt_len == len(w.prompt_ids)
            assert t.arrival == pytest.approx(run.start + w.arrival_s)
            assert t.arrival <= t.first_scheduled + 1e-3 and t.first_scheduled <= t.first_token
            assert t.token_times == sorted(t.token_times) and t.finish >= t.token_times[-1]
    assert [r.output_ids for r in runs[0].requests] == [r.output_ids for r in runs[1].requests]
    assert [r.output_ids for r in runs[0].requests] == [r.output_ids for r in runs[2].requests]
    # Our engine logs what each step fed: every prompt token once, then each output token but
    # the last (nothing was preempted in a pool this size).
    fed = sum(s.num_decodes + s.num_prefill_tokens for s in runs[0].steps)
    assert fed == sum(len(w.prompt_ids) + w.max_new_tokens - 1 for w in workload)


def test_repeated_runs_take_turns_and_each_engine_is_built_once(tiny, monkeypatch):
    """With repeats, the plan runs in rounds (each system in turn, not each system's runs back
    to back, so that a slow minute falls on both), and every engine is kept for its next round;
    without, each engine is let go before the next is built (one KV pool at a time)."""
    built: list[tuple[str, int]] = []  # (system, engines alive when it was built)
    real_build = Systems._build

    def counting_build(self, system, budget):
        built.append((system, len(self.engines)))
        return real_build(self, system, budget)

    monkeypatch.setattr(Systems, "_build", counting_build)
    config = ServingBenchConfig(
        systems=("continuous", "static-naive"), max_num_batched_tokens=(16,), warmup=False,
        workload=WorkloadConfig(num_requests=3, prompt_len=(2, 8), output_len=(1, 4), seed=2),
        repeats=3)
    results = run_serving_bench(tiny, config, progress=False)
    assert results.runs.system.tolist() == ["continuous", "static-naive"] * 3
    assert results.runs.repeat.tolist() == [0, 0, 1, 1, 2, 2]
    assert built == [("continuous", 0), ("static-naive", 1)]
    assert sorted(results.requests.groupby(["system", "repeat"]).size()) == [3] * 6
    assert set(results.steps.repeat) == {0, 1, 2}  # the continuous engine's steps, each round
    medians = median_of_repeats(results.runs)
    assert medians.system.tolist() == ["continuous", "static-naive"]
    assert medians.runs.tolist() == [3, 3] and "repeat" not in medians
    assert (medians.output_throughput_min <= medians.output_throughput).all()
    assert (medians.output_throughput <= medians.output_throughput_max).all()

    built.clear()
    run_serving_bench(tiny, replace(config, repeats=1), progress=False)
    assert built == [("continuous", 0), ("static-naive", 0)]


def test_a_budget_sweep_takes_each_budget_in_turn_and_builds_each_engine_once(tiny,
                                                                                 monkeypatch):
    """Every system serves at one budget before any serves at the next (on a drifting host a
    sweep of each system's budgets back to back compares the host's minutes, not the budgets);
    a system without a budget serves once; one KV pool at a time."""
    built: list[tuple[str, int, int]] = []  # (system, budget, engines alive when it was built)
    real_build = Systems._build

    def counting_build(self, system, budget):
        built.append((system, budget, len(self.engines)))
        return real_build(self, system, budget)

    monkeypatch.setattr(Systems, "_build", counting_build)
    config = ServingBenchConfig(
        systems=("continuous", "static-naive", "prefix-cache"),
        max_num_batched_tokens=(16, 32), warmup=False,
        workload=WorkloadConfig(num_requests=3, prompt_len=(2, 8), output_len=(1, 4), seed=2))
    runs = run_serving_bench(tiny, config, progress=False).runs
    assert list(zip(runs.system, runs.max_num_batched_tokens.fillna(0).astype(int),
                    strict=True)) == [("continuous", 16), ("static-naive", 0),
                                      ("prefix-cache", 16), ("continuous", 32),
                                      ("prefix-cache", 32)]
    assert built == [("continuous", 16, 0), ("static-naive", 16, 0), ("prefix-cache", 16, 0),
                     ("continuous", 32, 0), ("prefix-cache", 32, 0)]


def test_median_of_repeats_groups_a_run_by_what_tells_runs_apart():
    runs = pd.DataFrame({
        "system": ["b", "a", "b", "a", "b", "a", "a"],
        "max_num_batched_tokens": [math.nan] * 6 + [64],  # a static system has no budget
        "repeat": [0, 0, 1, 1, 2, 2, 0],
        "output_throughput": [10.0, 4.0, 30.0, 5.0, 20.0, 9.0, 7.0],
        "ttft_p99_ms": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
        "date": ["d0", "d0", "d1", "d1", "d2", "d2", "d0"]})
    medians = median_of_repeats(runs)
    assert medians.system.tolist() == ["b", "a", "a"]  # in the order first met
    assert medians.runs.tolist() == [3, 3, 1]
    assert medians.output_throughput.tolist() == [20.0, 5.0, 7.0]
    assert medians.output_throughput_min.tolist() == [10.0, 4.0, 7.0]
    assert medians.output_throughput_max.tolist() == [30.0, 9.0, 7.0]
    assert medians.ttft_p99_ms.tolist() == [3.0, 4.0, 7.0] and medians.date.tolist()[0] == "d0"
    single = runs[runs.repeat == 0].drop(columns="repeat")
    assert median_of_repeats(single).output_throughput.tolist() == [10.0, 4.0, 7.0]


def test_a_recording_in_another_dtype_writes_its_tables_in_their_own_folder(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr("miniinfer.bench.devices.YOURS_DIR", tmp_path)  # a recording of yours
    config = ServingBenchConfig(
        systems=("continuous",), max_num_batched_tokens=(16,), warmup=False, chapter="11",
        workload=WorkloadConfig(num_requests=2, request_rate=40.0, prompt_len=(2, 8),
                                output_len=(1, 3), seed=0))
    runs, paths = serving_records.record_serving(torch.device("cpu"), "11", "tiny",
                                                 {"target": config}, dtype=torch.bfloat16,
                                                 subdir="bf16")
    assert [p.parent for p in paths] == [tmp_path / "ch11" / "bf16"] * 3
    assert [p.stem.rsplit("-", 1)[1] for p in paths] == ["runs", "requests", "steps"]
    assert set(runs.dtype) == {"bfloat16"} and set(runs.experiment) == {"target"}
    assert set(pd.read_csv(paths[1]).dtype) == {"bfloat16"}


def test_a_recording_cut_off_keeps_the_experiments_that_finished(tmp_path, monkeypatch):
    """The H200's first chapter 08 run was stopped by the lease's end after two of three
    experiments and wrote nothing: each finished experiment is on disk at once now."""
    monkeypatch.setattr("miniinfer.bench.devices.YOURS_DIR", tmp_path)  # a recording of yours
    config = ServingBenchConfig(
        systems=("continuous",), max_num_batched_tokens=(16,), warmup=False, chapter="08",
        workload=WorkloadConfig(num_requests=2, request_rate=40.0, prompt_len=(2, 8),
                                output_len=(1, 3), seed=0))
    real = serving_records.run_serving_bench

    def cut_off_at_the_second(lm, cfg):
        if cfg is not config:
            raise KeyboardInterrupt  # what the lease's end (SIGINT) raises in the second
        return real(lm, cfg)

    monkeypatch.setattr(serving_records, "run_serving_bench", cut_off_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        serving_records.record_serving(torch.device("cpu"), "08", "tiny",
                                       {"first": config, "second": replace(config)})
    written = sorted((tmp_path / "ch08").glob("*.csv"))
    assert [p.name.rsplit("-", 1)[1] for p in written] == ["requests.csv", "runs.csv",
                                                            "steps.csv"]
    runs = pd.read_csv(next(p for p in written if p.name.endswith("-runs.csv")))
    assert set(runs.experiment) == {"first"} and len(runs) == 1


def test_cli_bench_serving_writes_tidy_csvs(tmp_path):
    out = tmp_path / "serving.csv"
    assert main(["bench-serving", "--model", "tiny", "--device", "cpu", "--systems",
                 "continuous,static-naive", "--num-requests", "4", "--prompt-len", "4,16",
                 "--output-len", "2,5", "--request-rates", "inf,30",
                 "--max-num-batched-tokens", "8,64", "--no-warmup", "--out", str(out)]) == 0
    runs = pd.read_csv(out)
    assert len(runs) == 2 * 3  # rates x (continuous at two budgets + static once)
    assert sorted(runs.system.unique()) == ["continuous", "static-naive"]
    required = ["chapter", "system", "model", "dtype", "request_rate", "max_num_batched_tokens",
                "num_requests", "output_tokens", "duration_s", "request_throughput",
                "output_throughput", "ttft_p50_ms", "tpot_p99_ms", "itl_p90_ms", "e2e_mean_ms",
                "device", "device_name", "torch", "transformers", "git_sha", "date"]
    assert set(required) <= set(runs.columns)
    assert (runs.output_tokens == runs.output_tokens[0]).all()
    requests = pd.read_csv(tmp_path / "serving-requests.csv")
    assert len(requests) == 6 * 4 and requests.ttft_ms.gt(0).all()
    steps = pd.read_csv(tmp_path / "serving-steps.csv")
    assert set(steps.system) == {"continuous"}


@pytest.mark.parametrize(("args", "message"), [
    (["--systems", "continuous,warp"], "unknown serving system 'warp'"),
    (["--prompt-len", "9"], "expected a range LOW,HIGH"),
    (["--request-rates", "0"], "request_rate must be > 0"),
    (["--dataset", "/nonexistent.jsonl"], "does not exist"),
    (["--repeats", "0"], "repeats must be >= 1, got 0"),
])
def test_cli_bench_serving_user_errors(args, message, capsys):
    assert main(["bench-serving", "--model", "tiny", "--num-requests", "2", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
