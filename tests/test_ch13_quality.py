"""Chapter 13's quality table: one row per weight format, perplexity against fp32's, top-1
agreement with fp32, and the columns every recorded table carries (on the tiny model: the
table's shape and invariants, not SmolLM2's numbers)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import miniinfer.lab.quantization as chapter13
from miniinfer.bench.devices import device_slug, run_metadata
from miniinfer.bench.quality import AGREEMENT_PROMPTS, QUALITY_FORMATS, quality_text, windows


@pytest.fixture(scope="module")
def quality(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    patch = pytest.MonkeyPatch()
    patch.setattr(chapter13, "recording_root", lambda: root)
    try:
        paths = chapter13.record_quality(torch.device("cpu"), tiny)
    finally:
        patch.undo()
    assert paths == [root / "ch13" / f"{device_slug(torch.device('cpu'))}-quality.csv"]
    return pd.read_csv(paths[0], dtype={"git_sha": str})


def test_one_row_per_format_with_the_run_metadata(quality, tiny):
    assert list(quality.weights) == list(QUALITY_FORMATS) == ["fp32", "int8", "int4"]
    needed = {"model", "dtype", "compute_dtype", "weight_bytes", "text_tokens", "window",
              "tokens_scored", "perplexity", "ppl_ratio", "ppl_change_pct", "prompts",
              "new_tokens", "top1_agree", "positions", "agreement",
              *run_metadata(torch.device("cpu"))}
    assert needed <= set(quality.columns), sorted(needed - set(quality.columns))
    assert set(quality.model) == {tiny.name} and set(quality.device) == {"cpu"}
    assert quality.git_sha.notna().all() and quality.torch.notna().all()
    # The quantized rows' activations: int8 in chapter 13's kernel where it runs, else bf16.
    from miniinfer.runner.quantized import default_compute_dtype

    kernel = str(default_compute_dtype()).removeprefix("torch.")
    assert list(quality.compute_dtype) == ["float32", kernel, kernel]


def test_perplexity_is_against_fp32s_over_every_token_of_the_text(quality, tiny):
    ids = tiny.tokenizer.encode(quality_text())
    assert set(quality.text_tokens) == {len(ids)}
    assert set(quality.tokens_scored) == {sum(len(w) - 1 for w in windows(ids, 512))}
    assert set(quality.window) == {512}
    assert all(math.isfinite(p) and p > 1 for p in quality.perplexity)
    fp32 = quality.set_index("weights").loc["fp32"]
    assert fp32.ppl_ratio == 1 and fp32.ppl_change_pct == 0
    expected = quality.perplexity / fp32.perplexity
    assert (quality.ppl_ratio - expected).abs().max() < 1e-9
    assert (quality.ppl_change_pct - 100 * (expected - 1)).abs().max() < 1e-6
    # Fewer bytes a step: each format reads less than the one above it.
    assert quality.weight_bytes.is_monotonic_decreasing


def test_agreement_is_a_share_of_the_fp32_continuations_positions(quality):
    assert set(quality.prompts) == {len(AGREEMENT_PROMPTS)}
    assert set(quality.positions) == {len(AGREEMENT_PROMPTS) * 32}
    assert ((quality.agreement >= 0) & (quality.agreement <= 1)).all()
    assert (quality.agreement == quality.top1_agree / quality.positions).all()
    # fp32 against itself: 1 by construction (written, not measured).
    assert quality.set_index("weights").loc["fp32", "agreement"] == 1


def test_windows_score_every_token_but_each_windows_first():
    assert [len(w) for w in windows(list(range(1030)), 512)] == [512, 512, 6]
    assert [len(w) for w in windows(list(range(1025)), 512)] == [512, 512]  # a 1-token tail: none


def test_a_gpu_records_no_quality_table_and_says_why(capsys):
    assert chapter13.record_quality(torch.device("cuda")) == []
    assert "CPU only" in capsys.readouterr().out


def test_all_prompts_at_once_continue_as_each_alone(tiny):
    """The packed greedy (one step for every prompt, keys and values kept) gives each prompt's
    one-at-a-time greedy tokens (fp32 tiny model: no near-ties in these)."""
    from miniinfer.bench.quality import greedy_continuation, greedy_continuations
    from miniinfer.runner.model import load

    model = load(tiny.model)
    prompts = [tiny.tokenizer.encode(p) for p in AGREEMENT_PROMPTS[:4]]
    assert greedy_continuations(model, prompts, 6) == [greedy_continuation(model, p, 6)
                                                         for p in prompts]
