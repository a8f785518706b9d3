"""The README's headline results are facts about the reference recordings: each figure it states
is computed here from the reference CSVs, so a figure that no recording supports fails."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from miniinfer.book.chapters import reference_device
from miniinfer.book.results import RESULTS, read_results

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def bench(chapter: str, kind: str) -> pd.DataFrame:
    return read_results(RESULTS / f"ch{chapter}" / f"{reference_device(chapter, kind)}.csv")


def pct_of_hf(chapter: str, kind: str, engine: str, batch: int) -> pd.Series:
    df = bench(chapter, kind)
    return df[(df.engine == engine) & (df.batch_size == batch)].iloc[0]


def within_noise(row: pd.Series) -> bool:
    return row.pct_of_hf_min <= 100 <= row.pct_of_hf_max


def runs(chapter: str, slug: str) -> pd.DataFrame:
    return read_results(RESULTS / f"ch{chapter}" / f"{slug}-runs.csv")


def served(chapter: str, slug: str, experiment: str) -> pd.DataFrame:
    df = runs(chapter, slug)
    return df[df.experiment == experiment].set_index("system")


CPU = reference_device("08", "cpu")


def speculation() -> pd.DataFrame:
    return read_results(RESULTS / "ch14" / f"{reference_device('14', 'cpu')}-speculative.csv")


def composed() -> pd.DataFrame:
    return read_results(RESULTS / "ch15" / f"{reference_device('15', 'cpu')}-composed.csv")


def http_keeps() -> float:
    """Chapter 10: the median over rounds of HTTP / in-process output tok/s (rounds alternate
    in-process and HTTP, so the n-th of each pair up)."""
    target = runs("10", reference_device("10", "cpu")).query("experiment == 'target'")
    inproc = target[target.system == "continuous"].output_throughput.to_numpy()
    http = target[target.system == "http"].output_throughput.to_numpy()
    return float(pd.Series(http / inproc).median())


# (the README's phrase, the figure computed from the reference recording)
FACTS = [
    ("`naive` within noise of hf at batch 1 and 8",
     lambda: all(within_noise(pct_of_hf("01", "cpu", "naive", b)) for b in (1, 8))),
    ("ties hf at batch 1 and 4",
     lambda: all(within_noise(pct_of_hf("01", "cuda", "naive", b)) for b in (1, 4))),
    ("`paged-loop` 75% of hf at batch 8",
     lambda: round((r := pct_of_hf("02", "cpu", "paged-loop", 8)).pct_of_hf) == 75
     and r.pct_of_hf_max < 100),
    ("42% of hf at batch 8", lambda: round(pct_of_hf("02", "cuda", "paged-loop", 8).pct_of_hf) == 42),
    ("`paged-vectorized` 78% at batch 8, within noise of the loop in its run",
     lambda: round((v := pct_of_hf("03", "cpu", "paged-vectorized", 8)).pct_of_hf) == 78
     and v.pct_of_hf_min <= (p := pct_of_hf("03", "cpu", "paged-loop", 8)).pct_of_hf_max
     and p.pct_of_hf_min <= v.pct_of_hf_max),
    ("46% at batch 8", lambda: round(pct_of_hf("03", "cuda", "paged-vectorized", 8).pct_of_hf) == 46),
    ("`paged-prealloc` within noise of hf",
     lambda: all(within_noise(pct_of_hf("04", "cpu", "paged-prealloc", b)) for b in (1, 8))),
    ("`paged-attention` 92% and 86% of hf at batch 1 and 8: the eager forward is the step",
     lambda: [round(pct_of_hf("06", "cpu", "paged-attention", b).pct_of_hf) for b in (1, 8)]
     == [92, 86] and all(pct_of_hf("06", "cpu", "paged-attention", b).pct_of_hf_max < 100
                         for b in (1, 8))),
    ("| within noise of hf |",
     lambda: all(within_noise(pct_of_hf("06", "cuda", "paged-attention", b)) for b in (1, 4, 8))),
    ("no loop beats hf (nothing to hide)",
     lambda: all(pct_of_hf("07", "cpu", e, b).pct_of_hf_min < 100
                 for e in ("async:sync", "async:overlap") for b in (1, 8))),
    ("`async:cuda-graph` 231-260% of hf",
     lambda: sorted(round(pct_of_hf("07", "cuda", "async:cuda-graph", b).pct_of_hf)
                    for b in (1, 4, 8))[::2] == [231, 260]),
    ("1.33x `hf-cb`'s output tok/s",
     lambda: round((t := served("08", CPU, "target").output_throughput)
                   ["continuous"] / t["hf-cb"], 2) == 1.33),
    ("2.68x (H100)",
     lambda: round((t := served("08", "cuda-nvidia-h100-80gb-hbm3", "target").output_throughput)
                   ["continuous"] / t["hf-cb"], 2) == 2.68),
    ("shared 512-token prompt: TTFT 5.8x lower",
     lambda: round((t := served("09", reference_device("09", "cpu"), "shared-prefix").ttft_p50_ms)
                   ["continuous"] / t["prefix-cache"], 1) == 5.8),
    ("HTTP keeps 1.09 of in-process throughput (within noise)", lambda: round(http_keeps(), 2) == 1.09),
    ("2.82x hf, 1.30x vLLM at batch 1",
     lambda: (lambda s: (round(s["compiled"] / s["hf"], 2), round(s["compiled"] / s["vllm"], 2))
              )(bench("11", "cpu").query("batch_size == 1").set_index("engine").tok_s)
     == (2.82, 1.30)),
    ("TP=3 on 2 cores is a cost",
     lambda: (bench("12", "cpu").query("engine == 'tensor-parallel'").pct_of_hf_max < 100).all()),
    ("int4 1.7x and int8 1.4x compiled fp32's tok/s at batch 1",
     lambda: (lambda fp32, int8, int4: (round(int4.pct_of_hf / fp32.pct_of_hf, 1),
                                        round(int8.pct_of_hf / fp32.pct_of_hf, 1)) == (1.7, 1.4)
              and min(int4.pct_of_hf_min, int8.pct_of_hf_min) > fp32.pct_of_hf_max)(
         *(pct_of_hf("13", "cpu", e, 1) for e in ("compiled", "quantized:int8", "quantized:int4")))),
    ("the same tokens; 1.67x no drafts at batch 1 where the answer copies its input, never behind "
     "it alone; served from 8 clients up to 14% behind",
     lambda: (lambda d: d.query("run == 'batch-1'").same_tokens.astype(str).str.lower()
              .eq("true").all()
              and round((c := d.loc[("batch-1", "dense", "copy", "ngram")]).tok_s
                        / (p := d.loc[("batch-1", "dense", "copy", "no drafts")]).tok_s, 2) == 1.67
              and c.tok_s_min > p.tok_s_max
              and all(r.tok_s_max >= d.loc[(run, w, wl, "no drafts")].tok_s_min
                      for (run, w, wl, s), r in d.iterrows()
                      if run == "batch-1" and s in ("ngram", "suffix"))
              and round(min(r.tok_s / d.loc[(run, w, wl, "no drafts")].tok_s
                            for (run, w, wl, s), r in d.iterrows()
                            if run == "served" and s in ("ngram", "suffix")), 2) == 0.86)(
         speculation().set_index(["run", "weights", "workload", "system"]))),
    ("from 16 clients 1.2-1.5x llama-server's output tok/s, ahead of vLLM everywhere; alone on "
     "open-ended prompts 0.62x llama-server's",
     lambda: (lambda t: sorted(round(t[(w, 16, "composed")] / t[(w, 16, "llama-server")], 1)
                               for w in ("chat", "grounded", "open-ended"))[::2] == [1.2, 1.5]
              and all(t[(w, c, "composed")] > t[(w, c, "vllm")]
                      for w in ("chat", "grounded", "open-ended") for c in (1, 4, 16))
              and round(t[("open-ended", 1, "composed")] / t[("open-ended", 1, "llama-server")], 2)
              == 0.62)(
         composed().query("part == 'peers'").set_index(["workload", "clients", "system"])
         .output_throughput)),
]


@pytest.mark.parametrize("phrase, holds", FACTS, ids=[p for p, _ in FACTS])
def test_every_headline_figure_holds_in_the_reference_recording(phrase, holds):
    assert phrase in README
    assert holds(), phrase
