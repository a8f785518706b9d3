"""The notebooks' helpers for recorded results."""

from __future__ import annotations

import pandas as pd

from miniinfer.book import pct_of_hf_spread_table, read_results, speed_of_light_table


def test_commit_ids_stay_text(tmp_path):
    # "2638e60" is a valid float literal; read naively it becomes 2.638e63.
    path = tmp_path / "run.csv"
    pd.DataFrame({"chapter": ["07"], "git_sha": ["2638e60"], "date": ["2026-11-23"],
                  "tok_s": [1.0]}).to_csv(path, index=False)
    row = read_results(path).iloc[0]
    assert (row.chapter, row.git_sha) == ("07", "2638e60")


def test_speed_of_light_shares_rescale_to_one_bandwidth(monkeypatch):
    # Two runs of one device measured 10 and 30 GB/s: the median (20) becomes the reference, so
    # a 30% share measured against 10 GB/s is 15% against 20.
    runs = {
        "01": pd.DataFrame({"device_name": ["cpu"] * 2, "model": "m", "dtype": "float32",
                            "engine": ["hf", "naive"], "batch_size": 1,
                            "pct_of_floor": [30.0, 30.0], "bandwidth_gbs": [10.0, 10.0]}),
        "02": pd.DataFrame({"device_name": ["cpu"], "model": "m", "dtype": "float32",
                            "engine": ["paged-loop"], "batch_size": 1, "pct_of_floor": [10.0],
                            "bandwidth_gbs": [30.0]}),
    }
    monkeypatch.setattr("miniinfer.book.recorded_results",
                        lambda chapter: runs.get(chapter, pd.DataFrame()))
    table = speed_of_light_table(("01", "02")).iloc[0]
    assert table["hf"] == 15.0 and table["naive"] == 15.0 and table["paged-loop"] == 15.0


def test_spread_table_shows_each_engines_range_but_not_hfs():
    rows = [("hf", 100.0, 100.0, 100.0), ("paged-attention", 98.4, 91.6, 106.2)]
    df = pd.DataFrame([{"device_name": "cpu", "model": "m", "dtype": "float32", "batch_size": 8,
                        "engine": e, "pct_of_hf": p, "pct_of_hf_min": lo, "pct_of_hf_max": hi}
                       for e, p, lo, hi in rows])
    cells = pct_of_hf_spread_table(df).iloc[0]
    assert cells["hf"] == "100%"
    assert cells["paged-attention"] == "98% [92-106]"
    # Runs recorded before the range was kept show the median alone.
    old = pct_of_hf_spread_table(df.drop(columns=["pct_of_hf_min", "pct_of_hf_max"])).iloc[0]
    assert old["paged-attention"] == "98%"
