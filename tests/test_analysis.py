"""The book's analysis plumbing: the load guard, the device table (one speed of light per
device), the decode floor's compute roof, phase tables without negative time."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from miniinfer.bench.offline import make_prompts
from miniinfer.bench.profiling import phase_table, profile_decode
from miniinfer.core import devices
from miniinfer.core.devices import (
    DeviceSpeed,
    LoadGuard,
    decode_floor,
    device_speed,
    is_busy,
    read_devices,
    write_device,
)
from miniinfer.engines import make_engine


def test_busy_means_load_beyond_the_runs_own_threads_or_steal():
    # 2 cores, a 2-thread run: a load of 1.0 per core is the run itself.
    assert not is_busy(0.1, 1.0, 0.0, threads=2, cores=2)
    assert is_busy(0.25, 0.8, 0.0, threads=1, cores=2)  # 0.6 cores of someone else's work
    assert is_busy(0.0, 2.0, 0.0, threads=2, cores=2)  # two more runnable threads than ours
    assert is_busy(0.0, 0.5, 12.0, threads=1, cores=2)  # the hypervisor took 12% of the time
    assert not is_busy(0.0, 0.5, math.nan, threads=1, cores=2)  # no /proc/stat: no steal figure


def test_load_guard_records_columns_around_its_block():
    with LoadGuard(threads=1) as guard:
        sum(range(10_000))
    cols = guard.columns()
    assert set(cols) == {"load_before", "load_after", "steal_pct", "busy"}
    assert cols["load_before"] >= 0 and cols["load_after"] >= 0
    assert isinstance(cols["busy"], bool)


def test_device_table_round_trip_and_no_write_unless_stored(tmp_path, monkeypatch):
    path = tmp_path / "devices.csv"
    slug = devices.device_slug(torch.device("cpu"))
    fake = DeviceSpeed(slug, "a cpu", 12.5, 300.0, 2, "test", "2026-01-01")
    calls = []
    monkeypatch.setattr(devices, "measure_device", lambda d: calls.append(d) or fake)
    monkeypatch.setattr(devices, "_measured_this_process", {})
    assert device_speed(torch.device("cpu"), path) == fake
    assert not path.exists()  # a live run measures but never writes results
    assert device_speed(torch.device("cpu"), path) == fake and len(calls) == 1  # measured once
    device_speed(torch.device("cpu"), path, store=True, remeasure=True)
    assert read_devices(path) == {slug: fake} and len(calls) == 2
    other = DeviceSpeed("cuda-x", "x", 3000.0, math.nan, 0, "test", "2026-01-02")
    write_device(other, path)
    table = read_devices(path)
    assert table[slug] == fake and table["cuda-x"].bandwidth_gbs == 3000.0
    assert math.isnan(table["cuda-x"].peak_gflops)
    # Recorded now: read, not measured again.
    assert device_speed(torch.device("cpu"), path) == fake and len(calls) == 2
    assert list(pd.read_csv(path).columns) == list(devices.DEVICE_FIELDS)


def test_decode_floor_has_a_compute_roof(tiny):
    floor1 = decode_floor(tiny, 1, 64, bandwidth=1e9, peak_flops=1e12)
    assert floor1.bound == "memory" and floor1.step_ms == floor1.memory_ms
    # A tiny peak makes the same step compute-bound, and the floor follows the roof.
    floor8 = decode_floor(tiny, 8, 64, bandwidth=1e9, peak_flops=1e6)
    assert floor8.bound == "compute" and floor8.step_ms == floor8.compute_ms > floor8.memory_ms
    assert floor8.flops > 8 * floor1.flops * 0.99
    # No roof known: the memory floor alone.
    assert decode_floor(tiny, 8, 64, bandwidth=1e9).step_ms == floor8.memory_ms


@pytest.mark.parametrize("engine", ["paged-prealloc", "paged-attention"])
def test_phase_table_has_no_negative_time(tiny, engine):
    # paged-attention writes K/V inside model_forward: counted once, not twice.
    trace = profile_decode(make_engine(engine, tiny), make_prompts(tiny, 2, 8), steps=3)
    table = phase_table(trace).set_index("phase")
    assert (table.ms_per_step >= 0).all(), table
    step = table.loc["decode_step", "ms_per_step"]
    outer = table[(table.inside == "") & (table.index != "decode_step")]
    assert outer.ms_per_step.sum() == pytest.approx(step, rel=1e-9)
    if engine == "paged-attention":
        assert table.loc["write_decode_kv", "inside"] == "model_forward"


def test_context_sweep_rows_per_engine_and_length(tiny):
    from miniinfer.book.recordings import run_context_sweep
    from miniinfer.book.workloads import ContextSweep

    speed = DeviceSpeed("cpu-x", "x", 10.0, 100.0, 1, "test", "2026-01-01")
    df = run_context_sweep(tiny, ("hf", "paged-loop", "paged-attention"),
                           ContextSweep((8, 24), batch_size=2, new_tokens=4, profiled_steps=2),
                           speed, chapter="03")
    assert len(df) == 6 and set(df.context_len) == {8, 24}
    assert (df.kv_mb_per_step.loc[df.context_len == 24].iloc[0]
            > df.kv_mb_per_step.loc[df.context_len == 8].iloc[0])
    paged = df[df.engine != "hf"]
    assert paged.profiled_step_ms.notna().all() and (paged.unlabelled_ms >= 0).all()
    assert df[df.engine == "hf"].pct_of_hf.eq(100).all()
    assert {"load_before", "load_after", "busy"} <= set(df.columns)
    from miniinfer.book import context_phase_table, context_sentences

    lines = [line for line in context_sentences(df) if "caution" not in line]  # timing noise
    assert len(lines) == 4 and "K/V bookkeeping" in lines[2] and "K/V" not in lines[1]
    assert len(context_phase_table(df)) == 6
    import matplotlib

    matplotlib.use("Agg")
    from miniinfer.book import plot_context_sweep

    assert len(plot_context_sweep(df).axes) == 2


def test_context_sentences_flag_a_sweep_where_hf_gets_faster_with_more_context():
    from miniinfer.book import context_sentences

    df = pd.DataFrame({"device_name": "x", "batch_size": 8, "engine": "hf",
                       "context_len": [128, 256, 512], "step_ms": [117.0, 88.0, 100.0],
                       "pct_of_hf": 100.0})
    cautions = [line for line in context_sentences(df) if "caution" in line]
    assert cautions == ["  caution: hf's step falls from 117.0 ms at context 128 to 88.0 ms at "
                        "256; more context cannot take less time, so the machine drifted by 25% "
                        "between those single runs: read differences of that size as noise"]
    assert not [line for line in context_sentences(df.assign(step_ms=[88.0, 100.0, 117.0]))
                if "caution" in line]


def test_book_helpers_handle_old_and_new_results():
    import matplotlib

    matplotlib.use("Agg")
    from miniinfer import book

    old = book.recorded_results("06").drop(columns=["busy", "load_before", "load_after"],
                                           errors="ignore")  # recorded before the load guard and decode_tok_s
    assert "context_len" not in old.columns  # the sweep's CSV is not a benchmark
    assert "not recorded yet" in book.load_note(old)
    new = old.assign(load_before=0.1, load_after=0.5, steal_pct=0.0, busy=False)
    assert book.load_note(new).startswith("load: quiet machine")
    busy = new.assign(busy=new.index == 0)
    assert book.load_note(busy).startswith("RECORDED ON A BUSY MACHINE: 1 of")
    assert len(book.plot_what_it_buys(old).axes) == 3
    assert len(book.plot_by_device(old).axes) == 2
    assert book.recorded_context_sweeps("02").empty
    assert not book.speed_of_light_table().empty  # old runs: rescaled, no crash
    ab = book.ablation_table(new, [("paged-prealloc", "paged-attention", "x")])
    assert len(ab) == new.batch_size.nunique()
    rows = new.set_index(["engine", "batch_size"])
    b = new.batch_size.iloc[0]
    assert ab.loc[(new.device_name.iloc[0], b, "x"), "points of hf"] == round(
        rows.loc[("paged-attention", b), "pct_of_hf"] - rows.loc[("paged-prealloc", b), "pct_of_hf"], 1)


def test_phase_repeats_give_a_median_inside_its_spread(tiny):
    from miniinfer.bench.profiling import phase_repeats, profile_decode, top_ops

    df = phase_repeats(tiny, "paged-attention", (1, 2), prompt_len=8, steps=2, repeats=2)
    assert set(df.batch_size) == {1, 2} and (df.repeats == 2).all()
    assert (df.ms_min <= df.ms_per_step + 1e-12).all() and (df.ms_per_step <= df.ms_max + 1e-12).all()
    assert (df.ms_min >= 0).all()
    # Top ops are per measured decode step: nothing from prefill, no step longer than the step.
    trace = profile_decode(make_engine("paged-prealloc", tiny), make_prompts(tiny, 2, 8), steps=2)
    top = top_ops(trace, 5)
    step = phase_table(trace).set_index("phase").ms_per_step["decode_step"]
    assert (top.ms_per_step <= step).all() and list(top.columns) == ["name", "count_per_step",
                                                                      "ms_per_step"]


def test_host_split_and_timeline_lanes():
    import matplotlib

    matplotlib.use("Agg")
    from miniinfer.book import host_split, plot_timelines

    bars = pd.DataFrame({
        "lane": ["host"] * 6, "engine": ["a"] * 6,
        "name": ["decode_step", "model_forward", "sample"] * 2,
        "start_ms": [0.0, 1.0, 9.0, 12.0, 13.0, 21.0], "dur_ms": [10.0, 8.0, 1.0, 10.0, 7.0, 1.0]})
    split = host_split(bars).loc["a"]
    assert split.step_ms == 10 and split.forward_ms == 7.5 and split.bookkeeping_ms == 2.5
    assert split.bookkeeping_pct == 25 and split.between_steps_ms == 2
    labels = [t.get_text() for t in plot_timelines(bars).axes[0].get_yticklabels()]
    assert labels == ["a: host", "a: forward"]
