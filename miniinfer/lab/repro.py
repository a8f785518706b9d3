"""What ``make chapter-NN`` runs: the chapter's recording on this machine, then its notebook
executed (into ``data/yours/notebooks/``; over the stored one only with ``--for-book``); and what ``python -m miniinfer repro all`` runs: every chapter's
recording in order. What a chapter records is its entry in the chapter registry
(:mod:`miniinfer.book.chapters`); the recordings are :mod:`miniinfer.lab.recordings`, their
plans and time estimates :mod:`miniinfer.lab.plans`.

A reader's recording goes to ``data/yours/`` and is shown as theirs: it never changes the book.
The book's own tables are recorded with ``--for-book``, from a clean commit only, into
``data/results/``; each chapter's duration is logged (``data/results/logs/repro-<commit>.csv``),
so a stopped ``repro all --for-book`` resumes where it stopped at the same commit, and
``--dry-run`` estimates from the durations the last run logged."""

from __future__ import annotations

import csv
import datetime as dt
import gc
import os
import subprocess
import time
from pathlib import Path

import torch

from ..bench.devices import FOR_BOOK_ENV, REPO_ROOT, RESULTS_DIR, git_sha
from ..book.chapters import CHAPTERS
from ..book.overview import CHAPTERS_DIR
from ..core.errors import MiniInferError, UnknownNameError
from ..core.hardware import YOURS_DIR
from ..core.models import resolve_device
from .plans import ChapterPlan, plan_chapter, plan_table
from .recordings import RECORDERS, run_chapter_context


def executed_notebook_path(chapter: str, for_book: bool) -> Path:
    """Where the chapter's executed notebook goes: over the stored one only when recording the
    book (the stored notebooks are the book); a reader's run goes beside their recordings."""
    name = CHAPTERS[chapter].notebook
    return CHAPTERS_DIR / name if for_book else YOURS_DIR / "notebooks" / name


def execute_notebook(chapter: str, for_book: bool = False) -> None:
    """Execute the chapter notebook with the full preset into
    :func:`executed_notebook_path`. Headless machines without jupyter (our GPU box) skip this
    step; the CSV is what they contribute."""
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError:
        print("nbclient not installed: notebook not re-executed (the CSV is written)")
        return
    nb = nbformat.read(CHAPTERS_DIR / CHAPTERS[chapter].notebook, as_version=4)
    os.environ.setdefault("MINIINFER_PRESET", "full")
    # Run where the stored notebook lives, whatever file the result goes to: its cells read
    # paths relative to chapters/.
    NotebookClient(nb, timeout=3600, kernel_name="python3",
                   resources={"metadata": {"path": str(CHAPTERS_DIR)}}).execute()
    out = executed_notebook_path(chapter, for_book)
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    print(f"executed notebook: {out}"
          + ("" if for_book else " (yours; open it in JupyterLab beside the book's)"))


REPRO_LOGS = RESULTS_DIR / "logs"
LOG_FIELDS = ("chapter", "device", "seconds", "notebook", "finished")
# What a recording for the book may change in the tree: its own outputs.
RECORDING_OUTPUTS = ("data/results/", "chapters/")


def uncommitted_changes() -> list[str]:
    """Paths with uncommitted changes outside what a recording writes (untracked files count)."""
    out = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                         text=True).stdout
    paths = [line[3:] for line in out.splitlines() if line.strip()]
    return [p for p in paths if not p.startswith(RECORDING_OUTPUTS)]


def start_book_recording() -> Path:
    """Refuse a dirty tree, switch recordings to the book's folder, return the run's log."""
    changed = uncommitted_changes()
    if changed:
        raise MiniInferError("--for-book records the book's tables from a commit, and this tree "
                             f"has uncommitted changes: {', '.join(changed[:5])}")
    os.environ[FOR_BOOK_ENV] = "1"
    return REPRO_LOGS / f"repro-{git_sha()}.csv"


def logged_seconds(path: Path) -> dict[tuple[str, str], float]:
    """(chapter, device type) -> seconds, from a repro log (empty when there is none)."""
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        return {(r["chapter"], r["device"]): float(r["seconds"]) for r in csv.DictReader(f)}


def last_logged_seconds(logs: Path | None = None) -> dict[tuple[str, str], float]:
    """Each chapter's duration in its most recently finished logged run (by the log's own
    ``finished`` stamps: a clone's files all share one mtime)."""
    latest: dict[tuple[str, str], tuple[str, float]] = {}
    for path in (logs or REPRO_LOGS).glob("repro-*.csv"):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                key = (r["chapter"], r["device"])
                if key not in latest or r.get("finished", "") > latest[key][0]:
                    latest[key] = (r.get("finished", ""), float(r["seconds"]))
    return {key: seconds for key, (_, seconds) in latest.items()}


def log_chapter(path: Path, chapter: str, device: torch.device, seconds: float,
                notebook: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        if new:
            writer.writerow(LOG_FIELDS)
        writer.writerow([chapter, device.type, round(seconds, 1), "yes" if notebook else "no",
                         dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")])


def reproduce(chapter: str, device: str | None = "auto", execute_notebook_too: bool = True,
              for_book: bool = False) -> None:
    chapter = check_chapter(chapter)
    if for_book:
        log = start_book_recording()
        started = time.perf_counter()
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
        execute_notebook(chapter, for_book)
    if for_book:
        log_chapter(log, chapter, dev, time.perf_counter() - started, execute_notebook_too)


def check_chapter(chapter: str) -> str:
    given = chapter.strip()
    chapter = given.zfill(2) if given.isdigit() else given  # "1" is chapter 01, "" none
    if chapter not in CHAPTERS:
        raise UnknownNameError(f"unknown chapter {given!r}; chapters: {', '.join(CHAPTERS)}")
    return chapter


def reproduce_all(chapters: list[str] | None = None, device: str | None = "auto",
                  execute_notebooks: bool = True, dry_run: bool = False,
                  for_book: bool = False) -> list[ChapterPlan]:
    """Every chapter's recording (or those in ``chapters``), in order. Notebooks are
    re-executed after their chapter where jupyter is installed (a headless machine only
    records; the notebooks can run later anywhere from the CSVs). ``dry_run``: run nothing,
    print each chapter's plan and the estimated total. ``for_book``: into the book's results,
    skipping the chapters this commit's log already has."""
    selected = [check_chapter(c) for c in chapters] if chapters else list(CHAPTERS)
    # Planning never touches the device: `--dry-run --device cuda` works on a CPU machine.
    dev = resolve_device(device) if not dry_run or device in (None, "auto") \
        else torch.device(device)
    plans = [plan_chapter(c, dev, last_logged_seconds()) for c in selected]
    print(plan_table(selected, plans, dev))
    if dry_run:
        return plans
    done = logged_seconds(start_book_recording()) if for_book else {}
    for chapter in selected:
        if (chapter, dev.type) in done:
            print(f"== chapter {chapter}: recorded at this commit already ==", flush=True)
            continue
        print(f"== chapter {chapter} ==", flush=True)
        reproduce(chapter, dev, execute_notebook_too=execute_notebooks, for_book=for_book)
    return plans
