"""What ``make chapter-NN`` runs: the chapter's benchmark on this machine, written to
``data/results/chNN/<device-slug>.csv``, then the notebook re-executed in place.

Defaults follow the device: on CUDA the reference posts' model (random-weight Qwen2.5-7B, bf16),
on CPU the real SmolLM2-135M in fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .bench import BenchConfig, run_bench, summary_table
from .devices import REPO_ROOT, device_slug
from .errors import UnknownNameError
from .models import load_model, resolve_device

RESULTS = REPO_ROOT / "data" / "results"
CHAPTERS_DIR = REPO_ROOT / "chapters"


@dataclass(frozen=True, slots=True)
class ChapterRun:
    notebook: str
    engines: tuple[str, ...]


# Each chapter benchmarks every stage built so far, so its ratios come from one run.
_STAGES = ("hf", "naive", "paged-loop", "paged-vectorized", "paged-prealloc")
CHAPTERS: dict[str, ChapterRun] = {
    "01": ChapterRun("01_naive_hf_decode.ipynb", _STAGES[:2]),
    "02": ChapterRun("02_paged_kv_cache.ipynb", _STAGES[:3]),
    "03": ChapterRun("03_vectorized_gather.ipynb", _STAGES[:4]),
    "04": ChapterRun("04_preallocated_buffers.ipynb", _STAGES[:5]),
}


def default_workload(device: torch.device) -> tuple[str, BenchConfig]:
    """Model and benchmark sizes for a chapter run on this device."""
    if device.type == "cuda":
        return "qwen2.5-7b", BenchConfig(batch_sizes=(1, 4, 8), prompt_len=64, new_tokens=128,
                                         warmup=2, repeat=5)
    return "smollm2-135m", BenchConfig(batch_sizes=(1, 4, 8), prompt_len=64, new_tokens=64,
                                       warmup=1, repeat=3)


def results_path(chapter: str, device: torch.device) -> Path:
    return RESULTS / f"ch{chapter}" / f"{device_slug(device)}.csv"


def run_chapter_bench(chapter: str, device: str | torch.device | None = "auto") -> Path:
    run = CHAPTERS[chapter]
    dev = resolve_device(device)
    model, base = default_workload(dev)
    config = BenchConfig(**{**{f: getattr(base, f) for f in base.__slots__},
                            "engines": run.engines, "chapter": chapter})
    lm = load_model(model, device=dev)
    df = run_bench(lm, config)
    print(summary_table(df).to_string(index=False))
    out = results_path(chapter, dev)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(f"wrote {out.relative_to(REPO_ROOT)}")
    return out


def execute_notebook(chapter: str) -> None:
    """Re-execute the chapter notebook in place with the full preset. Headless machines
    without jupyter (our GPU box) skip this step; the CSV is what they contribute."""
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError:
        print("nbclient not installed: notebook not re-executed (the CSV is written)")
        return
    path = CHAPTERS_DIR / CHAPTERS[chapter].notebook
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("MINIINFER_PRESET", "full")
    NotebookClient(nb, timeout=3600, kernel_name="python3",
                   resources={"metadata": {"path": str(CHAPTERS_DIR)}}).execute()
    nbformat.write(nb, path)
    print(f"re-executed {path.relative_to(REPO_ROOT)}")


def reproduce(chapter: str, device: str | None = "auto", execute_notebook_too: bool = True) -> None:
    chapter = chapter.zfill(2)
    if chapter not in CHAPTERS:
        raise UnknownNameError(f"unknown chapter {chapter!r}; chapters: {', '.join(CHAPTERS)}")
    run_chapter_bench(chapter, device)
    if execute_notebook_too:
        execute_notebook(chapter)
