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


def served(chapter: str, slug: str, experiment: str) -> pd.DataFrame:
    df = read_results(RESULTS / f"ch{chapter}" / f"{slug}-runs.csv")
    return df[df.experiment == experiment].set_index("system")


# (the README's phrase, the figure computed from the reference recording)
FACTS = [
    ("`paged-loop` 71% of hf at batch 8",
     lambda: round(pct_of_hf("02", "cpu", "paged-loop", 8).pct_of_hf) == 71),
    ("42% of hf at batch 8", lambda: round(pct_of_hf("02", "cuda", "paged-loop", 8).pct_of_hf) == 42),
    ("`paged-vectorized` 82% at batch 8",
     lambda: round(pct_of_hf("03", "cpu", "paged-vectorized", 8).pct_of_hf) == 82),
    ("46% at batch 8", lambda: round(pct_of_hf("03", "cuda", "paged-vectorized", 8).pct_of_hf) == 46),
    ("`naive` ties hf at batch 1 and 4",
     lambda: all(within_noise(pct_of_hf("01", k, "naive", b)) for k in ("cpu", "cuda")
                 for b in (1, 4))),
    ("`paged-prealloc` within noise of hf",
     lambda: all(within_noise(pct_of_hf("04", "cpu", "paged-prealloc", b)) for b in (1, 4, 8))),
    ("| within noise of hf | within noise of hf |",
     lambda: all(within_noise(pct_of_hf("06", k, "paged-attention", b)) for k in ("cpu", "cuda")
                 for b in (1, 4, 8))),
    ("`async:cuda-graph` 231-260% of hf",
     lambda: sorted(round(pct_of_hf("07", "cuda", "async:cuda-graph", b).pct_of_hf)
                    for b in (1, 4, 8))[::2] == [231, 260]),
    ("1.91x `hf-cb`'s output tok/s",
     lambda: round((t := served("08", "cpu-amd-epyc-avx512", "target").output_throughput)
                   ["continuous"] / t["hf-cb"], 2) == 1.91),
    ("2.68x (H100)",
     lambda: round((t := served("08", "cuda-nvidia-h100-80gb-hbm3", "target").output_throughput)
                   ["continuous"] / t["hf-cb"], 2) == 2.68),
    ("2.18x hf, 1.25x vLLM at batch 1 (Zen 3)",
     lambda: (lambda s: (round(s["compiled"] / s["hf"], 2), round(s["compiled"] / s["vllm"], 2))
              )(bench("11", "cpu").query("batch_size == 1").set_index("engine").tok_s)
     == (2.18, 1.25)),
]


@pytest.mark.parametrize("phrase, holds", FACTS, ids=[p for p, _ in FACTS])
def test_every_headline_figure_holds_in_the_reference_recording(phrase, holds):
    assert phrase in README
    assert holds(), phrase
