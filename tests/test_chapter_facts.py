"""What a chapter's prose says of its reference recording, checked against the recorded CSVs.

The chapters state their results in words; the checks live here, not in the notebooks' teaching
cells. When the book is recorded again, a failure here names the sentence to rewrite."""

from __future__ import annotations

import pandas as pd
import pytest

from miniinfer.book import RESULTS, read_results, recorded_results, reference_files
from miniinfer.book.chapters import reference_device


def _cpu(files):
    return [f for f in files if f.name.startswith("cpu-")]


def _verdict(lo: float, hi: float, base_lo: float, base_hi: float) -> str:
    """Ahead (+), behind (-) or within noise (=) of a base, by the two runs' ranges."""
    return "+" if lo > base_hi else "-" if hi < base_lo else "="


def test_ch05_the_matmuls_stand_above_their_roofs_by_what_the_chapter_states(smollm2):
    """Chapter 05's roofline text: the matmuls take 4.9x, 7.8x, 3.6x and 1.5x their time at the
    roofs at batch 1, 8, 32 and 128, batch 1's reading the weights at 10.0 GB/s, a fifth of the
    copy roof, batch 128's at 66% of peak; its cost model's 52 ms of matmuls in an 80 ms
    profiled batch-1 step."""
    from miniinfer.book.roofline import recorded_rooflines

    rooflines = recorded_rooflines(smollm2.config)  # the reference CPU's, from its files
    if not rooflines:
        pytest.skip("no recorded roofline of the reference CPU")
    (roofline,) = rooflines
    matmuls = roofline.matmuls_against_roofs()
    above = matmuls["x their roofs' time"].round(1).to_dict()
    assert above == {1: 4.9, 8: 7.8, 32: 3.6, 128: 1.5}, above
    ms = matmuls["matmuls ms per step"]
    assert round(matmuls.bytes[1] / ms[1] / 1e6, 1) == 10.0
    assert round(roofline.bandwidth_gbs, 1) == 49.1 and round(roofline.peak_gflops, 1) == 187.8
    assert round(100 * matmuls.flops[128] / ms[128] / 1e6 / roofline.peak_gflops) == 66
    # The cost model's section: the profile's matmuls (aten::mm) in its batch-1 step.
    slug = reference_device("05", "cpu")
    top = read_results(RESULTS / "ch05" / f"{slug}-top.csv").query("batch_size == 1")
    phases = read_results(RESULTS / "ch05" / f"{slug}-phases.csv").query("batch_size == 1")
    assert round(top.set_index("name").ms_per_step["aten::mm"]) == 52
    assert round(phases.set_index("phase").ms_per_step["decode_step"]) == 80


def test_ch05_nearly_every_gpu_launch_of_a_step_is_inside_the_model_forward():
    """Chapter 05: on a GPU, over 95% of a decode step's kernel launches come from inside
    ``model_forward``."""
    from miniinfer.bench.profiling import load_trace

    traces = reference_files("05", "cuda-*-paged-prealloc-b*.json.gz")
    if not traces:
        pytest.skip("no recorded GPU trace of chapter 05")
    launches = """
        SELECT r.name AS range, count(e.name) / count(DISTINCT r.ts) AS launches
        FROM events r JOIN events e
          ON e.tid = r.tid AND e.ts >= r.ts AND e.ts + e.dur <= r.ts + r.dur
        WHERE r.cat = 'user_annotation' AND r.name IN ('decode_step', 'model_forward')
          AND e.cat = 'cuda_runtime' AND e.name LIKE 'cudaLaunchKernel%'
        GROUP BY r.name"""
    for path in traces:
        counts = load_trace(path).sql(launches).set_index("range").launches
        assert counts["model_forward"] > 0.95 * counts["decode_step"], path.name


def _ch13_runs() -> pd.DataFrame:
    runs = recorded_results("13")
    runs = runs[runs.device.astype(str).str.startswith("cpu")] if "device" in runs else runs
    if "engine" not in runs or runs.empty:
        pytest.skip("no reference recording of chapter 13")
    return runs[runs.engine.notna()].astype({"batch_size": int})


def test_ch09_the_cache_pays_where_the_chapter_says_and_the_no_hit_rows_drift_as_stated():
    """Chapter 09, one run per system: prefix-cache over continuous in output tok/s and TTFT
    p50 (lower by), the no-hit rows' drift and their decode-only steps, and the chats' turns."""
    def runs(slug):
        r = read_results(RESULTS / "ch09" / f"{slug}-runs.csv").set_index(["experiment", "system"])
        def ratio(experiment, column):
            cached, plain = (r.loc[(experiment, s), column] for s in ("prefix-cache", "continuous"))
            return cached / plain if column == "output_throughput" else plain / cached
        return ratio

    def decode_only_ms(slug, experiment):
        s = read_results(RESULTS / "ch09" / f"{slug}-steps.csv").query(
            "num_prefill_tokens == 0 and experiment == @experiment")
        ms = (s.end_s - s.start_s).groupby(s.system).median() * 1e3
        return round(ms["prefix-cache"], 1), round(ms["continuous"], 1)

    # The slugs the chapter shows (its GPU rows stand in from an H100).
    cpu, gpu = (next(f.name.removesuffix("-runs.csv") for f in reference_files("09", "*-runs.csv")
                     if f.name.startswith(kind)) for kind in ("cpu-", "cuda-"))
    ratio = runs(cpu)
    assert [round(ratio(e, "output_throughput"), 2) for e in ("prefix-len-0", "nothing-shared")] \
        + [round(1 / ratio(e, "ttft_p50_ms"), 2) for e in ("prefix-len-0", "nothing-shared")] \
        == [1.23, 1.02, 1.04, 1.17]  # TTFT 1.04x and 1.17x higher
    assert [round(x) for x in decode_only_ms(cpu, "prefix-len-0")
            + decode_only_ms(cpu, "nothing-shared")] == [114, 145, 148, 159]
    assert (round(ratio("shared-prefix", "ttft_p50_ms"), 1),
            round(ratio("shared-prefix", "output_throughput"), 1),
            round(ratio("prefix-len-1024", "ttft_p50_ms"), 1),
            round(ratio("prefix-len-256", "ttft_p50_ms"), 1)) == (5.8, 2.3, 4.3, 1.8)
    ratio = runs(gpu)
    assert [round(ratio(e, "output_throughput"), 2) for e in ("prefix-len-0", "prefix-len-128",
                                                    "nothing-shared")] == [1.25, 0.82, 1.14]
    assert [decode_only_ms(gpu, e) for e in ("prefix-len-0", "prefix-len-128", "nothing-shared")] \
        == [(21.7, 27.6), (28.1, 20.9), (21.9, 26.4)]
    ttft = [ratio(f"prefix-len-{n}", "ttft_p50_ms") for n in (256, 512, 1024)]
    assert (round(min(ttft), 1), round(max(ttft), 1)) == (2.5, 7.9)
    # The chats (chapter's last section): TTFT p50 per turn, what turn 2 finds cached.
    requests = read_results(RESULTS / "ch09" / f"{cpu}-requests.csv").query(
        "experiment == 'multi-turn'")
    per_turn = requests.pivot_table(index="turn", columns="system", values="ttft_ms",
                                    aggfunc="median")
    lower = per_turn.continuous / per_turn["prefix-cache"]
    assert [round(lower[t], 2 if t == 2 else 1) for t in (2, 3, 4)] == [1.18, 1.6, 2.8]
    assert (round(per_turn["prefix-cache"].loc[2:].min()), round(per_turn["prefix-cache"].loc[2:].max()),
            round(per_turn.continuous[4])) == (756, 851, 2327)
    turn_2 = requests.query("turn == 2 and system == 'prefix-cache'")
    assert (turn_2.cached_tokens.median(), turn_2.prompt_len.median()) == (32, 147)


def test_ch12_three_ranks_on_one_cpu_cost_what_the_chapter_says():
    """Chapter 12: TP=3 makes 0.20x of TP=1's tok/s at batch 1 and 0.31x at batch 8, every
    repeat below TP=1's; it adds 393 ms to a batch-1 step, of which the 60 all-reduces' estimate
    (the 4 KB p50 at N=3, the cell under the all-reduce table) is at most a fifth. The opening's
    70B figures (141 GB, 41.5 ms a step at 3.35 TB/s) are the paper table's."""
    from miniinfer.runner.tensor_parallel_costs import LLAMA_70B, paper_tensor_parallel

    slug = reference_device("12", "cpu")
    bench = read_results(RESULTS / "ch12" / f"{slug}.csv").set_index(["batch_size", "engine"])
    for batch, said in ((1, 0.20), (8, 0.31)):
        tp, whole = bench.loc[(batch, "tensor-parallel")], bench.loc[(batch, "continuous")]
        assert round(tp.tok_s / whole.tok_s, 2) == said, batch
        assert tp.pct_of_hf_max < whole.pct_of_hf_min, batch
    added = bench.loc[(1, "tensor-parallel")].step_ms - bench.loc[(1, "continuous")].step_ms
    assert round(added) == 393
    reduce = read_results(RESULTS / "ch12" / f"{slug}-allreduce.csv")
    p50_ms = reduce.query("world_size == 3 and message_bytes == 4096").p50_us.item() / 1e3
    assert 60 * p50_ms <= added / 5
    big = pd.DataFrame(paper_tensor_parallel(LLAMA_70B)).set_index("tp").loc[1]
    assert (round(big.weights_per_device_GB), round(big.bandwidth_floor_ms, 1)) == (141, 41.5)


def test_ch13_quantized_stages_against_fp32_where_the_chapter_says():
    """Chapter 13: at batch 1 each quantized stage's slowest repeat is above fp32 ``compiled``'s
    fastest, and int4 and int8 are within noise of each other; at batch 8 int8's slowest repeat
    is above fp32's fastest and int4's range meets fp32's (within noise)."""
    runs = _ch13_runs()
    one = runs[runs.batch_size == 1].set_index("engine")
    assert (one.loc[["quantized:int8", "quantized:int4"], "pct_of_hf_min"]
            > one.pct_of_hf_max["compiled"]).all()
    assert one.pct_of_hf_min["quantized:int4"] <= one.pct_of_hf_max["quantized:int8"]
    eight = runs[runs.batch_size == 8].set_index("engine")
    assert eight.pct_of_hf_min["quantized:int8"] > eight.pct_of_hf_max["compiled"]
    assert eight.pct_of_hf_min["quantized:int4"] <= eight.pct_of_hf_max["compiled"]


def test_ch13_both_formats_cost_some_perplexity_int4_less_than_int8():
    files = _cpu(reference_files("13", "*-quality.csv"))
    if not files:
        pytest.skip("no reference quality table of chapter 13")
    for path in files:
        change = read_results(path).set_index("weights").ppl_change_pct
        assert 0 < change["int4"] < change["int8"], path.name


def test_ch13_llama_cpp_leads_at_batch_1_and_in_fp32_and_trails_in_int8_and_int4_at_batch_8():
    """Chapter 13: at batch 1 llama.cpp's slowest repeat beats our median in every format; at
    batch 8 our int8 and int4 medians beat its fastest repeat, and in fp32 its slowest repeat
    still beats our median."""
    files = _cpu(reference_files("13", "*-llama-cpp.csv"))
    if not files:
        pytest.skip("no reference llama.cpp rows of chapter 13")
    peer = pd.concat([read_results(p) for p in files], ignore_index=True)
    runs = _ch13_runs().set_index(["batch_size", "engine"]).decode_tok_s
    ours = {"fp32": "compiled", "int8": "quantized:int8", "int4": "quantized:int4"}

    def pair(b: int, fmt: str):
        theirs = peer[(peer.batch_size == b) & (peer.ours == fmt)].iloc[0]
        return runs[(b, ours[fmt])], theirs

    for fmt in ours:
        mine, theirs = pair(1, fmt)
        assert theirs.decode_tok_s_min > mine, fmt
    for fmt in ("int8", "int4"):
        mine, theirs = pair(8, fmt)
        assert mine > theirs.decode_tok_s_max, fmt
    mine, theirs = pair(8, "fp32")
    assert theirs.decode_tok_s_min > mine


def test_ch14_speculation_keeps_the_tokens_and_wins_where_the_chapter_says():
    """Chapter 14: every system gives no drafts' tokens at batch 1; against no drafts each
    drafter (ngram, suffix) is faster (+), slower (-) or within noise (=) as the prose says."""
    files = _cpu(reference_files("14", "*-speculative.csv"))
    if not files:
        pytest.skip("no reference recording of chapter 14")
    said = {("batch-1", "dense", "rewrite"): "+=", ("batch-1", "dense", "copy"): "++",
            ("batch-1", "dense", "open-ended"): "+=", ("served", "dense", "grounded"): "==",
            ("served", "dense", "open-ended"): "--", ("batch-1", "int4", "rewrite"): "==",
            ("batch-1", "int4", "copy"): "++", ("batch-1", "int4", "open-ended"): "==",
            ("served", "int4", "grounded"): "==", ("served", "int4", "open-ended"): "=="}

    for path in files:
        df = read_results(path)
        assert df[df.run == "batch-1"].same_tokens.astype(str).str.lower().eq("true").all()
        by = df.set_index(["run", "weights", "workload", "system"])
        for key, expected in said.items():
            base = by.loc[(*key, "no drafts")]
            got = "".join(_verdict(r.tok_s_min, r.tok_s_max, base.tok_s_min, base.tok_s_max)
                          for r in (by.loc[(*key, s)] for s in ("ngram", "suffix")))
            assert got == expected, (key, got)
        copy = by.loc[("batch-1", "dense", "copy", "ngram")]
        assert round(copy.tok_s / by.loc[("batch-1", "dense", "copy", "no drafts")].tok_s, 2) \
            == 1.67
        assert copy.kept_drafts == "0:63 1:39 2:15 3:18"


def test_ch11_compiled_makes_the_multiples_of_hf_the_chapter_states():
    """Chapter 11: "2.84 times hf's tokens per second offline at batch 1 and 1.63 times at
    batch 8" on the reference CPU."""
    runs = recorded_results("11")
    runs = runs[runs.device.astype(str).str.startswith("cpu") & (runs.engine == "compiled")]
    if runs.empty:
        pytest.skip("no reference recording of chapter 11")
    said = {1: "2.84", 8: "1.63"}
    got = {int(b): f"{pct / 100:.2f}" for b, pct in zip(runs.batch_size, runs.pct_of_hf, strict=True)}
    assert got == said


def test_ch05_the_h200s_eager_step_takes_what_the_chapter_states():
    """Chapter 05: an eager H200 step "takes 22-24 ms unprofiled"."""
    runs = recorded_results("05")
    runs = runs[runs.device.astype(str).str.startswith("cuda") & runs.step_ms.notna()]
    if runs.empty:
        pytest.skip("no GPU recording of chapter 05")
    assert round(runs.step_ms.min()) == 22 and round(runs.step_ms.max()) == 24, runs.step_ms.tolist()


def test_ch01_hfs_step_against_both_roofs_is_what_the_chapter_states():
    """Chapter 01: on the reference CPU "hf's step is 6.5x the memory roof at batch 1, and 9.2x it
    and 9.1x the compute roof at batch 8" (the table's last two columns)."""
    runs = recorded_results("01")
    hf = runs[runs.device.astype(str).str.startswith("cpu") & (runs.engine == "hf")]
    if hf.empty:
        pytest.skip("no reference recording of chapter 01")
    hf = hf.set_index("batch_size")
    over = {b: (f"{r.step_ms / r.floor_memory_ms:.1f}", f"{r.step_ms / r.floor_compute_ms:.1f}")
            for b, r in hf.iterrows()}
    assert over[1][0] == "6.5" and over[8] == ("9.2", "9.1"), over


def test_ch15_the_whole_engine_against_the_peers_and_its_ablation_as_the_chapter_says():
    """Chapter 15: against llama-server, ahead (+), behind (-) or within noise (=) per workload
    and clients as "What it means" says; ahead of vLLM everywhere; the ablation's shares."""
    files = _cpu(reference_files("15", "*-composed.csv"))
    if not files:
        pytest.skip("no reference recording of chapter 15")
    df = read_results(files[0])
    served = df[df.part == "peers"].set_index(["workload", "clients", "system"])
    said = {("chat", 1): "=", ("grounded", 1): "=", ("open-ended", 1): "-",
            ("chat", 4): "+", ("grounded", 4): "+", ("open-ended", 4): "=",
            ("chat", 16): "+", ("grounded", 16): "+", ("open-ended", 16): "+"}
    for (workload, clients), expected in said.items():
        ours = served.loc[(workload, clients, "composed")]
        theirs = served.loc[(workload, clients, "llama-server")]
        got = _verdict(ours.output_throughput_min, ours.output_throughput_max,
                       theirs.output_throughput_min, theirs.output_throughput_max)
        assert got == expected, (workload, clients, got)
        vllm = served.loc[(workload, clients, "vllm")]
        assert ours.output_throughput_min > vllm.output_throughput_max, (workload, clients)
    ablation = df[df.part == "ablation"].set_index(["workload", "system"]).output_throughput
    shares = {key: round(ablation[key] / ablation[(key[0], "composed")], 2)
              for key in ablation.index if key[1] != "composed"}
    assert shares == {("chat", "- int4 (fp32 weights)"): 1.13, ("chat", "- compiled (eager)"): 0.71,
                      ("chat", "- prefix caching"): 0.85, ("chat", "- speculation"): 1.06,
                      ("grounded", "- int4 (fp32 weights)"): 1.15,
                      ("grounded", "- compiled (eager)"): 0.56,
                      ("grounded", "- prefix caching"): 0.76,
                      ("grounded", "- speculation"): 0.93}, shares
    # Its rounds start from an empty prefix cache: the whole engine makes less than served.
    for workload in ("chat", "grounded"):
        assert ablation[(workload, "composed")] < served.loc[(workload, 4, "composed")] \
            .output_throughput_min, workload
