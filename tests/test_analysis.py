"""The book's analysis plumbing: the load guard, the device table (one speed of light per
device), the decode floor's compute roof, phase tables without negative time."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

from miniinfer.bench import devices
from miniinfer.bench.devices import (
    DeviceSpeed,
    LoadGuard,
    decode_floor,
    device_speed,
    is_busy,
    read_devices,
    write_device,
)
from miniinfer.bench.offline import make_prompts
from miniinfer.bench.profiling import phase_table, profile_decode
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


def test_every_row_names_the_instruction_set_it_ran_with():
    """Hosts of one CPU name differ in what they can run (AVX-512 or AVX2 only): each row says
    which, as PyTorch dispatches to it (the same answer its kernels get)."""
    meta = devices.run_metadata(torch.device("cpu"))
    assert meta["isa"] == torch.backends.cpu.get_cpu_capability()
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    if os.environ.get("ATEN_CPU_CAPABILITY"):  # the user chose another dispatch: nothing to check
        return
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert meta["isa"].startswith("AVX512")
    elif "avx2" in flags:
        assert meta["isa"] == "AVX2"


def test_device_table_round_trip_and_no_write_unless_stored(tmp_path, monkeypatch):
    path = tmp_path / "devices.csv"
    slug = devices.device_slug(torch.device("cpu"))
    fake = DeviceSpeed(slug, "a cpu", 12.5, 300.0, 2, "test", "2026-01-01",
                       devices.device_isa(torch.device("cpu")))
    calls = []
    monkeypatch.setattr(devices, "measure_device", lambda d: calls.append(d) or fake)
    monkeypatch.setattr(devices, "_measured_this_process", {})
    assert device_speed(torch.device("cpu"), path) == fake
    assert not path.exists()  # a live run measures but never writes results
    assert device_speed(torch.device("cpu"), path) == fake and len(calls) == 1  # measured once
    device_speed(torch.device("cpu"), path, store=True, remeasure=True)
    assert read_devices(path) == {fake.key: fake} and len(calls) == 2
    other = DeviceSpeed("cuda-x", "x", 3000.0, math.nan, 0, "test", "2026-01-02", "sm_90")
    write_device(other, path)
    table = read_devices(path)
    assert table[fake.key] == fake and table["cuda-x", "sm_90"].bandwidth_gbs == 3000.0
    assert math.isnan(table["cuda-x", "sm_90"].peak_gflops)
    # Recorded now: read, not measured again.
    assert device_speed(torch.device("cpu"), path) == fake and len(calls) == 2
    assert list(pd.read_csv(path).columns) == list(devices.DEVICE_FIELDS)


def test_a_host_of_the_same_name_with_another_instruction_set_is_another_device(tmp_path,
                                                                                 monkeypatch):
    # A Zen 4 (AVX512) and a Zen 3 (AVX2) were both sold here as "AMD EPYC", with 49 and 16 GB/s:
    # the Zen 3 must not take the Zen 4's floor, and storing its own keeps the other row.
    path = tmp_path / "devices.csv"
    cpu = torch.device("cpu")
    slug, isa = devices.device_slug(cpu), devices.device_isa(cpu)
    elsewhere = DeviceSpeed(slug, "a cpu", 49.0, 190.0, 2, "test", "2026-01-01", "another-isa")
    write_device(elsewhere, path)
    here = DeviceSpeed(slug, "a cpu", 16.0, 100.0, 2, "test", "2026-01-02", isa)
    calls = []
    monkeypatch.setattr(devices, "measure_device", lambda d: calls.append(d) or here)
    monkeypatch.setattr(devices, "_measured_this_process", {})
    assert device_speed(cpu, path, store=True) == here and len(calls) == 1
    assert read_devices(path) == {elsewhere.key: elsewhere, here.key: here}
    assert device_speed(cpu, path) == here and len(calls) == 1


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


def test_context_sweep_rows_per_engine_and_length(tiny, monkeypatch):
    from miniinfer.book.workloads import ContextSweep
    from miniinfer.core import kv_cache
    from miniinfer.lab.recordings import run_context_sweep

    # A default pool of 3 blocks, too small for 2 requests of 24 + 4 tokens (2 blocks each):
    # the sweep sizes its engines' pools for its longest context (a GPU's 4,096 overflowed
    # the default 1 GiB of Qwen2.5-7B K/V).
    one_block = kv_cache.kv_bytes_per_block(tiny.config, tiny.dtype, kv_cache.DEFAULT_BLOCK_SIZE)
    monkeypatch.setattr(kv_cache, "DEFAULT_MEMORY_BYTES", 3 * one_block)
    speed = DeviceSpeed("cpu-x", "x", 10.0, 100.0, 1, "test", "2026-01-01")
    # Every plain run comes before the first profiled one (on a GPU, steps after a profiler
    # session ran slower).
    from miniinfer.bench import offline, profiling

    calls = []

    def logged(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return call

    for module, name in ((offline, "run_metrics"), (profiling, "profile_decode")):
        monkeypatch.setattr(module, name, logged(name, getattr(module, name)))
    df = run_context_sweep(tiny, ("hf", "paged-loop", "paged-attention"),
                           ContextSweep((8, 24), batch_size=2, new_tokens=4, profiled_steps=2),
                           speed, chapter="03")
    assert calls == ["run_metrics"] * 6 + ["profile_decode"] * 4
    assert len(df) == 6 and set(df.context_len) == {8, 24}
    assert (df.kv_mb_per_step.loc[df.context_len == 24].iloc[0]
            > df.kv_mb_per_step.loc[df.context_len == 8].iloc[0])
    paged = df[df.engine != "hf"]
    assert paged.profiled_step_ms.notna().all() and (paged.unlabelled_ms >= 0).all()
    assert df[df.engine == "hf"].pct_of_hf.eq(100).all()
    assert {"load_before", "load_after", "busy"} <= set(df.columns)
    import matplotlib

    matplotlib.use("Agg")
    from miniinfer.book import plot_context_sweep

    assert len(plot_context_sweep(df).axes) == 2


def test_book_helpers_handle_old_and_new_results():
    import matplotlib

    matplotlib.use("Agg")
    from miniinfer import book

    old = book.recorded_results("06").drop(columns=["busy", "load_before", "load_after"],
                                           errors="ignore")  # recorded before the load guard and decode_tok_s
    assert "context_len" not in old.columns  # the sweep's CSV is not a benchmark
    devices = old.device_name.nunique()  # every device recorded so far (a GPU's too)
    assert len(book.plot_what_it_buys(old).axes) == 3 * devices
    assert book.recorded_context_sweeps("02").empty
    assert not book.speed_of_light_table().empty  # old runs: rescaled, no crash
    ab = book.ablation_table(old, [("paged-prealloc", "paged-attention", "x")])
    assert len(ab) == old.groupby("device_name").batch_size.nunique().sum()  # per device
    first = old.device_name.iloc[0]
    rows = old[old.device_name == first].set_index(["engine", "batch_size"])
    b = old.batch_size.iloc[0]
    assert ab.loc[(first, b, "x"), "points of hf"] == round(
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
    assert "device_busy_pct" not in host_split(bars)  # a CPU's bars have no device lane
    # A GPU's: kernels from 2 to 6 and 4 to 8 (overlapping) and 15 to 17 in the window 0-22;
    # one before the window does not count.
    kernels = pd.DataFrame({"lane": "device", "engine": "a", "name": "k",
                            "start_ms": [2.0, 4.0, 15.0, -5.0], "dur_ms": [4.0, 4.0, 2.0, 3.0]})
    gpu = host_split(pd.concat([bars, kernels], ignore_index=True)).loc["a"]
    assert gpu.device_busy_ms == 4 and gpu.device_busy_pct == pytest.approx(100 * 8 / 22)


# -- every comparison sentence agrees with the recorded CSV it is printed from -------------
# Each test reads a chapter's recorded results (whatever the latest `make chapter-NN` wrote),
# generates the chapter's sentences and checks each claim against the numbers, computed here
# independently: a re-recording that changes a result changes the sentence, never contradicts it.

from miniinfer import book  # noqa: E402
from miniinfer.book import analysis, profiles  # noqa: E402

BENCH_CHAPTERS = ("01", "02", "03", "04", "06", "07")


def _recorded_runs(chapter: str, kind: str) -> pd.DataFrame:
    files = sorted((book.RESULTS / f"ch{chapter}").glob(f"*-{kind}.csv"))
    if not files:
        pytest.skip(f"chapter {chapter} has no recorded {kind}")
    return pd.concat([book.read_results(f) for f in files], ignore_index=True)


@pytest.mark.parametrize("chapter", BENCH_CHAPTERS + ("05",))
def test_pct_of_hf_and_the_tok_s_ratio_never_disagree_in_sign(chapter):
    df = book.recorded_results(chapter) if chapter != "05" else _recorded_runs("05", "bench")
    if df.empty:
        pytest.skip(f"chapter {chapter} not recorded")
    table = analysis.hf_ratio_table(df)
    assert table.agree.all(), table[~table.agree]
    for (_, _, engine), r in table.iterrows():
        # Where every repeat favoured one side, both figures sit on that side of 100%.
        if engine != "hf" and r.pct_of_hf_min > 100:
            assert r.pct_of_hf > 100 and r.tok_s_pct_of_hf > 100
        elif engine != "hf" and r.pct_of_hf_max < 100:
            assert r.pct_of_hf < 100 and r.tok_s_pct_of_hf < 100


def test_hf_verdict_rests_on_the_range_not_on_either_median():
    df = pd.DataFrame({"device_name": "x", "batch_size": 8, "engine": ["hf", "a", "b"],
                       "tok_s": [100.0, 97.0, 120.0], "pct_of_hf": [100.0, 101.0, 119.0],
                       "pct_of_hf_min": [100.0, 90.0, 104.0], "pct_of_hf_max": [100.0, 110.0, 130.0]})
    table = analysis.hf_ratio_table(df).loc[("x", 8)]
    # a: the median ratio says 101%, the ratio of medians 97%: opposite sides, one verdict.
    assert table.loc["a", "verdict"] == "within noise" and table.loc["a", "agree"]
    assert table.loc["b", "verdict"] == "faster" and table.loc["b", "agree"]
    bad = df.assign(tok_s=[100.0, 97.0, 95.0])  # every repeat faster, yet a slower median
    assert not analysis.hf_ratio_table(bad).loc[("x", 8, "b"), "agree"]


def test_ch04_prealloc_bookkeeping_grows_with_the_context_as_the_text_says():
    sweep = book.recorded_context_sweeps("04")
    if sweep.empty:
        pytest.skip("chapter 04 has no context sweep")
    for _, dev in sweep[sweep.engine == "paged-prealloc"].groupby("device_name"):
        kv = dev.set_index("context_len")[["gather_batch_kv_ms", "build_cache_ms",
                                           "write_decode_kv_ms"]].sum(axis=1).sort_index()
        assert kv.iloc[-1] > kv.iloc[0]


def test_ch06_ch07_host_share_is_what_chapter_05_recorded():
    phases = _recorded_runs("05", "phases")
    share = profiles.host_share(phases)
    for (name, b), r in share.iterrows():
        ms = phases[(phases.device_name == name) & (phases.batch_size == b)].set_index("phase")
        assert r.host_ms == pytest.approx(ms.ms_per_step["decode_step"]
                                          - ms.ms_per_step["model_forward"])
    on_cpu = phases[phases.device.astype(str).str.startswith("cpu")]
    # Chapters 05 and 07 say the host's share on a CPU is under 6% of a step (5.7% at batch 8
    # on the reference Xeon).
    assert (profiles.host_share(on_cpu).host_pct < 6).all()


@pytest.mark.parametrize("engine,gathers", [("paged-attention", True), ("paged-prealloc", False)])
def test_ch06_attention_gather_is_counted_where_the_reference_does_it(tiny, engine, gathers):
    trace = profile_decode(make_engine(engine, tiny), make_prompts(tiny, 2, 40), steps=2)
    assert (profiles.attention_gather_ms(trace) > 0) == gathers


def test_server_cost_p50_and_p99_of_the_paired_difference():
    n = 60
    cost = pd.DataFrame({"device_name": "x", "mode": ["stream"] * n + ["no-stream"] * n,
                         "in_process_ttft_ms": [50.0] * n + [float("nan")] * n,
                         "http_ttft_ms": [50.0 + i / 10 for i in range(n)] + [float("nan")] * n,
                         "in_process_e2e_ms": [500.0] * 2 * n,
                         "http_e2e_ms": [503.0] * n + [500.0 + i for i in range(n)]})
    table = analysis.server_cost_table(cost)
    stream, plain = table.loc[("x", "stream")], table.loc[("x", "no-stream")]
    assert stream["ttft_ms p50 diff"] == pytest.approx(pd.Series(range(n)).median() / 10)
    assert plain["e2e_ms p99 diff"] == pytest.approx(pd.Series(range(n), dtype=float).quantile(0.99))
    assert pd.isna(plain.get("ttft_ms p50 diff"))


# -- the roofline (chapter 05; reused by 06 and 07) ------------------------------------------

def test_decode_ops_count_the_flops_and_bytes_of_a_step(smollm2):
    from miniinfer.book.roofline import OPS, decode_ops

    ops = decode_ops(smollm2.config, batch_size=1, context_len=100).set_index("op")
    assert list(ops.index) == list(OPS)
    # Every weight is read once a step: the matmuls' weight bytes are the model's (less the
    # norms, a few KB).
    weights = ops.weight_bytes.sum()
    assert 0.999 < weights / smollm2.weight_bytes <= 1.0
    # A GEMV does 2 FLOPs per weight it reads (4 bytes in fp32): 0.5 FLOP per byte and a bit less.
    assert ops.loc["QKV", "intensity"] == pytest.approx(0.5, rel=0.01)
    eight = decode_ops(smollm2.config, batch_size=8, context_len=100).set_index("op")
    assert eight.loc["gate/up", "flops"] == 8 * ops.loc["gate/up", "flops"]
    assert 3.5 < eight.loc["gate/up", "intensity"] < 4.0
    # Attention's intensity does not grow with the batch (each request reads its own K/V).
    assert eight.loc["attention", "intensity"] == pytest.approx(ops.loc["attention", "intensity"])


def test_op_times_attribute_every_matmul_of_a_step_by_its_order(tiny):
    from miniinfer.book.roofline import record_op_times, roofline_table

    ops = record_op_times(tiny, (1, 2), prompt_len=8, steps=2)
    layers = tiny.config.num_hidden_layers
    counts = ops[ops.batch_size == 1].set_index("op").count_per_step
    assert counts.to_dict() == {"QKV": 3 * layers, "O": layers, "gate/up": 2 * layers,
                                "down": layers, "LM head": 1, "attention": layers}
    assert (ops.ms_per_step > 0).all() and (ops.context_len == 8 + 1 + 1.5).all()
    table = roofline_table(tiny.config, ops, bandwidth_gbs=10.0, peak_gflops=100.0,
                           batch_sizes=(1, 2, 32))
    measured = table[table.ms_per_step.notna()]
    assert set(measured.batch_size) == {1, 2} and table[table.batch_size == 32].ms_per_step.isna().all()
    row = measured.iloc[0]
    assert row.achieved_gflops == pytest.approx(row.flops / (row.ms_per_step / 1e3) / 1e9)
    assert row.attainable_gflops == min(100.0, 10.0 * row.intensity)


def test_op_times_refuse_a_step_whose_matmuls_it_cannot_tell_apart(tiny):
    from miniinfer.book.roofline import op_times
    from miniinfer.core.errors import MiniInferError

    trace = profile_decode(make_engine("paged-prealloc", tiny), make_prompts(tiny, 1, 8), steps=2)
    with pytest.raises(MiniInferError, match="aten::mm per decode step"):
        op_times(trace, tiny.config.num_hidden_layers + 1)


def test_chapter05_roofline_points_from_the_recorded_traces(smollm2):
    """What chapter 05 draws from the reference CPU's recorded traces: each matmul's time per
    step, split by op, adds up to the recorded top table's ``aten::mm``, and every matmul point
    has both roofs' shares."""
    from miniinfer.bench.profiling import load_trace
    from miniinfer.book.chapters import reference_device
    from miniinfer.book.roofline import recorded_trace_op_times, roofline_table

    slug = reference_device("05", "cpu")
    paths = sorted((book.RESULTS / "ch05").glob(f"{slug}-paged-prealloc-b*.json.gz"))
    if not paths:
        pytest.skip("no recorded chapter 05 trace on the reference CPU")
    traces = {int(p.name.split("-b")[-1].split(".")[0]): load_trace(p) for p in paths}
    ops = recorded_trace_op_times(traces, smollm2.config.num_hidden_layers, prompt_len=64)
    devices = book.device_table()
    speed = devices[devices.slug == slug].iloc[0]
    table = roofline_table(smollm2.config, ops, speed.bandwidth_gbs, speed.peak_gflops)
    top = book.read_results(book.RESULTS / "ch05" / f"{slug}-top.csv")
    for b in traces:
        mm = top[(top.batch_size == b) & (top.name == "aten::mm")].ms_per_step.iloc[0]
        matmuls = ops[(ops.batch_size == b) & (ops.op != "attention")].ms_per_step.sum()
        assert matmuls == pytest.approx(mm, rel=1e-6)  # the same time, split by op
    matmuls = table[(table.op != "attention") & table.ms_per_step.notna()]
    assert set(matmuls.batch_size) == set(traces)
    assert (matmuls.pct_of_bandwidth > 0).all() and (matmuls.pct_of_peak > 0).all()


# -- chapter 02: the memory paging saves -------------------------------------------------------

def test_kv_reservation_matches_the_bytes_the_live_caches_hold(tiny):
    from transformers import DynamicCache

    from miniinfer.bench.devices import kv_bytes_per_token
    from miniinfer.book.analysis import kv_reservation
    from miniinfer.core.sampling import SamplingParams
    from miniinfer.engines.base import left_pad

    lengths = (3, 16, 17, 40)
    prompts = [make_prompts(tiny, 1, n, seed=i)[0] for i, n in enumerate(lengths)]
    ids, mask = left_pad(prompts, tiny.pad_token_id, tiny.device)
    cache = DynamicCache(config=tiny.config)
    with torch.inference_mode():
        tiny.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                   position_ids=(mask.cumsum(-1) - 1).clamp(min=0), logits_to_keep=1)
    hf_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    engine = make_engine("paged-loop", tiny, block_size=16, num_blocks=32)
    pool = engine.kv_cache
    with torch.inference_mode():
        engine.prefill(list(range(len(prompts))), prompts, SamplingParams(max_new_tokens=1))
    paged_bytes = (pool.num_blocks - pool.block_manager.num_free_blocks) * pool.nbytes // pool.num_blocks
    table = kv_reservation(lengths, kv_bytes_per_token(tiny), 16)
    assert list(table.reserved_MiB) == [hf_bytes / 2**20, paged_bytes / 2**20]
    # 4 x 40 padded slots for 76 tokens; blocks of 16: 16 + 16 + 32 + 48 = 112 slots.
    assert list(table.reserved_tokens) == [160, 112]
    assert table.fragmentation_pct.iloc[0] == pytest.approx(100 * (1 - 76 / 160))
    assert table.fragmentation_pct.iloc[1] == pytest.approx(100 * (1 - 76 / 112))


# -- chapter 10: the server's own cost --------------------------------------------------------

def test_server_cost_recording_pairs_each_request_in_process_and_over_http(tiny):
    from miniinfer.bench.serving import WorkloadConfig
    from miniinfer.lab.recordings import record_server_cost
    from miniinfer.server import ServerProcess

    workload = WorkloadConfig(num_requests=3, prompt_len=(4, 12), output_len=(2, 4), seed=1)
    engine = make_engine("continuous", tiny, max_num_batched_tokens=64)
    with ServerProcess("tiny", "--device", "cpu") as server:
        cost = record_server_cost(tiny, engine, server.base_url, workload, warmup=1)
    assert list(cost["mode"]) == ["stream", "no-stream"] * 3
    assert list(cost.request[::2]) == [0, 1, 2]
    stream, whole = cost[cost["mode"] == "stream"], cost[cost["mode"] == "no-stream"]
    timed = ["in_process_e2e_ms", "http_e2e_ms"]
    assert (cost[timed] > 0).all().all()
    assert (stream[["in_process_ttft_ms", "http_ttft_ms"]] > 0).all().all()
    assert whole[["in_process_ttft_ms", "http_ttft_ms"]].isna().all().all()
    assert not engine.has_unfinished_requests()
    table = analysis.server_cost_table(cost)
    assert set(table.index.get_level_values("mode")) == {"stream", "no-stream"}
    assert (table.requests == 3).all()
