"""The benchmark's bookkeeping, with scripted engines whose speeds are known exactly."""

from __future__ import annotations

import pandas as pd
import pytest

from miniinfer.bench.offline import BenchConfig, paired_pct, run_bench
from miniinfer.engines import GenerationResult, make_engine


class ScriptedEngine:
    """Takes ``seconds[i]`` (simulated) for its i-th generate and logs the order of calls."""

    def __init__(self, name: str, seconds: list[float], log: list[str]) -> None:
        self.name, self.seconds, self.log = name, iter(seconds), log

    def generate(self, prompts, params) -> GenerationResult:
        self.log.append(self.name)
        total = next(self.seconds)
        steps = params.max_new_tokens
        # Prefill takes a step's time too; token_times are evenly spaced.
        times = [total * (i + 1) / steps for i in range(steps)]
        return GenerationResult([[0] * steps for _ in prompts], 0.0, times, total)


def test_paired_pct_is_the_median_of_per_repeat_ratios():
    hf = [{"tok_s": t} for t in (100, 50, 100)]
    fast = [{"tok_s": t} for t in (110, 60, 90)]  # ratios 110%, 120%, 90%
    assert paired_pct(fast, hf) == pytest.approx(
        {"pct_of_hf": 110, "pct_of_hf_min": 90, "pct_of_hf_max": 120})
    # A ratio of medians would say 90 / 100 = 90%: the drift of repeat 2 hid the gain.


def test_bench_rotates_order_and_pairs_repeats(tiny):
    log: list[str] = []
    # Warm-up then 3 repeats. The machine halves its speed in repeat 2: both engines slow
    # down, and each repeat's ratio (hf time / fast time) stays exactly 1.25.
    engines = {"hf": ScriptedEngine("hf", [1.0, 1.0, 2.0, 1.0], log),
               "fast": ScriptedEngine("fast", [0.8, 0.8, 1.6, 0.8], log)}
    config = BenchConfig(engines=tuple(engines), batch_sizes=(2,), prompt_len=4, new_tokens=4,
                         warmup=1, repeat=3)
    df = run_bench(tiny, config, engines).set_index("engine")
    assert log == ["hf", "fast", "hf", "fast", "fast", "hf", "hf", "fast"]
    assert df.loc["fast", "pct_of_hf"] == pytest.approx(125)
    assert df.loc["fast", "pct_of_hf_min"] == pytest.approx(125)
    assert df.loc["fast", "pct_of_hf_max"] == pytest.approx(125)
    assert df.loc["hf", "tok_s"] == pytest.approx(2 * 4 / 1.0)


def test_pct_of_hf_is_against_hf_wherever_it_is_listed(tiny):
    # hf listed last: every ratio is still to hf, and hf is 100% of itself.
    engines = {"fast": ScriptedEngine("fast", [0.5, 0.5], []),
               "slow": ScriptedEngine("slow", [2.0, 2.0], []),
               "hf": ScriptedEngine("hf", [1.0, 1.0], [])}
    config = BenchConfig(engines=tuple(engines), batch_sizes=(1,), prompt_len=4, new_tokens=4,
                         warmup=0, repeat=2)
    df = run_bench(tiny, config, engines).set_index("engine")
    assert df.pct_of_hf.to_dict() == pytest.approx({"fast": 200, "slow": 50, "hf": 100})


def test_ttft_and_tpot_from_the_token_times(tiny):
    # 4 tokens stamped at 0.25, 0.5, 0.75 and 1.0 s after the start: TTFT is 250 ms and TPOT,
    # the time per token after the first, (1.0 - 0.25) / (4 - 1) = 250 ms.
    engines = {"hf": ScriptedEngine("hf", [1.0], [])}
    config = BenchConfig(engines=("hf",), batch_sizes=(3,), prompt_len=4, new_tokens=4,
                         warmup=0, repeat=1)
    row = run_bench(tiny, config, engines).iloc[0]
    assert row.ttft_ms == pytest.approx(250) and row.tpot_ms == pytest.approx(250)
    assert row.step_ms == pytest.approx(250) and row.tok_s == pytest.approx(3 * 4 / 1.0)


def test_the_ratio_interval_is_a_bootstrap_of_the_rounds_median():
    from miniinfer.bench.race import ratio_interval

    assert ratio_interval([1.5] * 5) == (1.5, 1.5)  # no spread, no width
    low, high = ratio_interval([1.2, 1.4, 1.5, 1.6, 1.9])
    assert 1.2 <= low <= 1.5 <= high <= 1.9 and low < high
    # The interval is the median's, not the rounds': one wild round in ten does not widen it.
    low, high = ratio_interval([1.4, 1.4, *[1.5] * 7, 9.0])
    assert 1.4 <= low and high == 1.5


def test_the_step_breakdown_puts_the_quantized_linears_in_the_weight_kernels(tiny):
    """The four parts of a steady decode step, on the int4 kernel's eager stage: the weight
    kernels are the quantized linears' own time, the host the unwatched step minus every
    kernel, and nothing is left running or holding blocks afterwards."""
    from miniinfer.bench.breakdown import CATEGORIES, step_breakdown
    from miniinfer.core.kernels import cpu_quantized

    if cpu_quantized.load() is not None:
        pytest.skip(f"the quantized kernel does not run here: {cpu_quantized.load()}")
    engine = make_engine("quantized:int4-eager", tiny)
    df = step_breakdown(engine, batch=2, prompt_len=8, steps=4, warmup=1).set_index("category")
    ms = df["ms"]
    assert list(ms.index) == [*CATEGORIES, "step"] and (ms >= 0).all()
    # The eager forward's norms and attention are ATen ops called one at a time: host work.
    assert ms["weight-reading kernels"] > 0 and ms["ATen ops"] > 0 and ms["engine Python"] > 0
    parts = ms[list(CATEGORIES)].sum()
    kernels = ms["weight-reading kernels"] + ms["other kernels"]
    assert parts == pytest.approx(max(ms["step"], kernels))
    assert not engine.has_unfinished_requests()
    manager = engine.kv_cache.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_the_kernel_rows_benchmark_times_every_linear_of_a_step(tiny):
    from miniinfer.bench.kernels import quantized_linear_rows
    from miniinfer.core.kernels import cpu_quantized

    if cpu_quantized.load() is not None:
        pytest.skip(f"the quantized kernel does not run here: {cpu_quantized.load()}")
    df = quantized_linear_rows(tiny, "int4", (1, 4), repeats=2)
    layers = tiny.config.num_hidden_layers
    assert df["rows"].tolist() == [1, 4]
    assert (df["linears"] == 4 * layers + 1).all()  # qkv, out, gate_up, down a layer; the head
    assert df["vs_one_row"].iloc[0] == 1 and (df["gb_s"] > 0).all()


def test_bench_breakdown_prints_and_writes_one_row_per_engine_and_batch(tmp_path, capsys):
    from miniinfer.bench.breakdown import CATEGORIES
    from miniinfer.cli import main

    out = tmp_path / "breakdown.csv"
    main(["bench", "--model", "tiny", "--device", "cpu", "--engines", "continuous",
          "--batch-sizes", "1,2", "--prompt-len", "8", "--breakdown", "--out", str(out)])
    df = pd.read_csv(out)
    assert df[["engine", "batch_size"]].values.tolist() == [["continuous", 1], ["continuous", 2]]
    assert set(CATEGORIES) | {"step", "git_sha", "device_name"} <= set(df.columns)
    assert (df["step"] > 0).all() and "weight-reading kernels" in capsys.readouterr().out
