"""The serving chapters' tables on disk: every experiment's runs, requests and steps."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from ..bench.devices import REPO_ROOT, device_slug, recording_root
from ..bench.serving import ServingBenchConfig, run_serving_bench
from ..bench.serving import summary_table as serving_summary_table
from ..core.models import load_model


def record_serving(dev: torch.device, chapter: str, model: str,
                   experiments: dict[str, ServingBenchConfig], dtype: torch.dtype | None = None,
                   subdir: str = "") -> tuple[pd.DataFrame, list[Path]]:
    """Run every serving experiment and write ``data/results/chNN/<device>-{runs,requests,
    steps}.csv`` (in ``chNN/<subdir>/`` if given), each row tagged with its experiment; returns
    the runs table and the paths. ``dtype``: the model's (None: its default)."""
    lm = load_model(model, device=dev, dtype=dtype)
    tables: dict[str, list[pd.DataFrame]] = {"runs": [], "requests": [], "steps": []}
    out_dir = recording_root() / f"ch{chapter}" / subdir
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {kind: out_dir / f"{device_slug(dev)}-{kind}.csv" for kind in tables}
    for done, (name, config) in enumerate(experiments.items(), 1):
        results = run_serving_bench(lm, config)
        print(f"{name}:\n{serving_summary_table(results.runs).to_string(index=False)}")
        # Written after every experiment, so a run cut off (a GPU lease's end) keeps those
        # that finished; the files are complete once the last one is.
        for kind, frames in tables.items():
            frames.append(getattr(results, kind).assign(experiment=name))
            pd.concat(frames, ignore_index=True).to_csv(paths[kind], index=False)
        shown = out_dir.relative_to(REPO_ROOT) if out_dir.is_relative_to(REPO_ROOT) else out_dir
        print(f"wrote {shown}/{device_slug(dev)}-{{{','.join(tables)}}}.csv "
              f"({done} of {len(experiments)} experiments)")
    return pd.concat(tables["runs"], ignore_index=True), list(paths.values())
