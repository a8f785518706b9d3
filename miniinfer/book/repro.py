"""What ``make chapter-NN`` runs: the chapter's recording on this machine (``data/results/chNN/``),
then its notebook re-executed in place; and what ``python -m miniinfer repro all`` runs: every
chapter's recording in order. What a chapter records is its entry in the chapter registry
(:mod:`miniinfer.book.chapters`); the recordings are :mod:`miniinfer.book.recordings`, their
plans and time estimates :mod:`miniinfer.book.plans`."""

from __future__ import annotations

import gc
import os

import torch

from ..core.devices import REPO_ROOT
from ..core.errors import UnknownNameError
from ..core.models import resolve_device
from .chapters import CHAPTERS
from .overview import CHAPTERS_DIR
from .plans import ChapterPlan, plan_chapter, plan_table
from .recordings import RECORDERS, run_chapter_context


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
    chapter = check_chapter(chapter)
    entry = CHAPTERS[chapter]
    dev = resolve_device(device)
    RECORDERS[entry.recording](chapter, dev)
    if entry.context_sweep:
        run_chapter_context(chapter, dev)
    # The chapter's model is garbage by now: give its memory back before the notebook's kernel
    # (or the next chapter) loads one of its own.
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if execute_notebook_too:
        execute_notebook(chapter)


def check_chapter(chapter: str) -> str:
    given = chapter.strip()
    chapter = given.zfill(2) if given.isdigit() else given  # "1" is chapter 01, "" none
    if chapter not in CHAPTERS:
        raise UnknownNameError(f"unknown chapter {given!r}; chapters: {', '.join(CHAPTERS)}")
    return chapter


def reproduce_all(chapters: list[str] | None = None, device: str | None = "auto",
                  execute_notebooks: bool = True, dry_run: bool = False) -> list[ChapterPlan]:
    """Every chapter's recording (or those in ``chapters``), in order, into data/results/.
    Notebooks are re-executed after their chapter where jupyter is installed (a headless
    machine only records; the notebooks can run later anywhere from the CSVs). ``dry_run``:
    run nothing, print each chapter's plan and the estimated total."""
    selected = [check_chapter(c) for c in chapters] if chapters else list(CHAPTERS)
    # Planning never touches the device: `--dry-run --device cuda` works on a CPU machine.
    dev = resolve_device(device) if not dry_run or device in (None, "auto") \
        else torch.device(device)
    plans = [plan_chapter(c, dev) for c in selected]
    print(plan_table(selected, plans, dev))
    if dry_run:
        return plans
    for chapter in selected:
        print(f"== chapter {chapter} ==", flush=True)
        reproduce(chapter, dev, execute_notebook_too=execute_notebooks)
    return plans
