"""CLI: generate and bench produce what they promise (bad input: tests/test_cli_errors.py)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from miniinfer.cli import main


def test_generate_json_naive_equals_hf(capsys):
    args = ["generate", "--model", "smollm2-135m", "--device", "cpu", "--prompt",
            "The capital of France is", "--prompt", "Hi", "--max-new-tokens", "8", "--json"]
    outputs = {}
    for engine in ("naive", "hf"):
        assert main([*args, "--engine", engine]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        outputs[engine] = [json.loads(line) for line in lines]
    assert [o["token_ids"] for o in outputs["naive"]] == [o["token_ids"] for o in outputs["hf"]]
    first = outputs["naive"][0]
    assert first["prompt"] == "The capital of France is" and "Paris" in first["text"]


def test_generate_reads_jsonl(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "One"}\n"Two"\n')
    assert main(["generate", "--model", "tiny", "--prompts", str(path), "--max-new-tokens", "3",
                 "--ignore-eos", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["prompt"] for r in rows] == ["One", "Two"]
    assert all(len(r["token_ids"]) == 3 for r in rows)


def test_bench_writes_tidy_csv(tmp_path):
    """One row per engine and batch size, one column per variable (no index column), the run's
    settings and provenance on every row, and % of hf against hf though hf is not listed first."""
    out = tmp_path / "bench.csv"
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--engines", "naive,hf",
                 "--batch-sizes", "1,2", "--prompt-len", "8", "--new-tokens", "4", "--warmup",
                 "0", "--repeat", "2", "--chapter", "01", "--out", str(out)]) == 0
    df = pd.read_csv(out, dtype={"chapter": str})
    required = ["chapter", "engine", "model", "device", "device_name", "dtype", "batch_size",
                "prompt_len", "new_tokens", "repeats", "tok_s", "step_ms", "ttft_ms", "tpot_ms",
                "pct_of_hf", "torch", "transformers", "git_sha", "date"]
    assert set(required) <= set(df.columns) and df.columns.is_unique
    assert not any(c.startswith("Unnamed") for c in df.columns)
    assert sorted(zip(df.engine, df.batch_size, strict=True)) == \
        [("hf", 1), ("hf", 2), ("naive", 1), ("naive", 2)]
    settings = {"chapter": "01", "model": "tiny", "device": "cpu", "dtype": "float32",
                "prompt_len": 8, "new_tokens": 4, "repeats": 2}
    assert {k: df[k].unique().tolist() for k in settings} == {k: [v] for k, v in settings.items()}
    assert df[required].notna().all().all()
    assert (df[["tok_s", "step_ms", "ttft_ms", "tpot_ms", "pct_of_hf"]] > 0).all().all()
    assert df[df.engine == "hf"].pct_of_hf.tolist() == pytest.approx([100, 100])
    assert (df.pct_of_hf_min <= df.pct_of_hf).all() and (df.pct_of_hf <= df.pct_of_hf_max).all()


def test_generate_compiles_only_the_buckets_its_steps_meet(monkeypatch, capsys):
    # A cold `generate --engine compiled` once compiled every bucket's graph (24 of them, a
    # quarter of an hour on 2 cores) before its first token; a one-off run builds the engine
    # without the warm-up, so its steps compile the one or two buckets they meet.
    from miniinfer import engines

    built = []

    class Stop(Exception):
        pass

    def fake_make_engine(name, lm, **options):
        built.append((name, options))
        raise Stop

    monkeypatch.setattr(engines, "make_engine", fake_make_engine)
    with pytest.raises(Stop):
        main(["generate", "--model", "tiny", "--engine", "compiled", "--prompt", "Hello",
              "--max-new-tokens", "2"])
    with pytest.raises(Stop):
        main(["generate", "--model", "tiny", "--engine", "continuous", "--prompt", "Hello",
              "--max-new-tokens", "2"])
    assert built[0][0] == "compiled" and built[0][1]["warm_up"] is False
    assert "warm_up" not in built[1][1]  # engines that compile nothing take no such option
