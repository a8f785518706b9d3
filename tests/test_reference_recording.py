"""The book's CPU tables are one recording: one machine, one commit (issue 65), except a chapter
recorded again later, at its own clean commit on the same machine (chapter 13, issue 69)."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from miniinfer.bench.devices import REPO_ROOT
from miniinfer.book.chapters import CHAPTERS, REFERENCE_DEVICES, reference_device
from miniinfer.book.results import read_results, reference_files
from miniinfer.lab.repro import REPRO_LOGS

RECORDED = [number for number, ch in CHAPTERS.items() if ch.recording != "none"]


def cpu_reference_files(chapter: str):
    return [f for f in reference_files(chapter, "**/*.csv") if f.name.startswith("cpu-")]


def test_every_chapter_shows_the_one_reference_cpu():
    cpu = REFERENCE_DEVICES["cpu"]
    for chapter in RECORDED:
        assert reference_device(chapter, "cpu") == cpu, f"chapter {chapter} overrides the CPU"
        files = cpu_reference_files(chapter)
        assert files, f"chapter {chapter} has no recording of the reference CPU ({cpu})"
        strays = [f.name for f in files if not f.name.startswith(f"{cpu}")]
        assert not strays, f"chapter {chapter} shows another CPU's tables: {strays}"


def cpu_tables() -> dict[str, list[pd.DataFrame]]:
    """Each recorded chapter's CPU reference tables that name their commit, read."""
    tables = {chapter: [read_results(path) for path in cpu_reference_files(chapter)]
              for chapter in RECORDED}
    return {chapter: [df for df in dfs if "git_sha" in df] for chapter, dfs in tables.items()}


def committed_repro_logs() -> dict[str, pd.DataFrame]:
    """Commit -> its repro log, for the logs git tracks (a log on disk only does not count)."""
    tracked = subprocess.run(["git", "ls-files", "--", str(REPRO_LOGS)], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    logs = [REPO_ROOT / f for f in tracked if re.fullmatch(r"repro-[0-9a-f]+\.csv", Path(f).name)]
    return {path.stem.removeprefix("repro-"): pd.read_csv(path, dtype=str) for path in logs}


def check_cpu_commits(tables: dict[str, list[pd.DataFrame]],
                      logs: dict[str, pd.DataFrame]) -> tuple[str, dict[str, str]]:
    """The book's CPU recording is the commit most chapters carry; a chapter recorded again
    later (chapter 13, with its llama.cpp rows and quality table) carries one later commit.
    Every chapter: exactly one clean commit across all its CPU tables; every commit: its repro
    log committed and listing each chapter that carries it; a later commit: the same machine
    as the book's, its chapters' runs finished after the book's recording. Returns the book's
    commit and each chapter's."""
    commit_of: dict[str, str] = {}
    machines: dict[str, set[str]] = {}
    for chapter, dfs in tables.items():
        shas = {sha for df in dfs for sha in df.git_sha.dropna()}
        assert len(shas) == 1, f"chapter {chapter}'s CPU tables carry {sorted(shas)}, not one commit"
        (sha,) = shas
        commit_of[chapter] = sha
        machines.setdefault(sha, set()).update(
            name for df in dfs if "device_name" in df for name in df.device_name.dropna())
    counts = Counter(commit_of.values())
    book, carried = counts.most_common(1)[0]
    assert carried > len(commit_of) / 2, f"no commit carries most chapters: {dict(counts)}"
    assert len(machines[book]) == 1, f"the book's recording names {sorted(machines[book])}"
    for sha in counts:
        assert not sha.endswith("-dirty"), f"a recording at uncommitted code: {sha}"
        assert sha in logs, f"the repro log of {sha} (data/results/logs/repro-{sha}.csv) is not committed"
        cpu = logs[sha][logs[sha].device == "cpu"]
        chapters = {chapter for chapter, s in commit_of.items() if s == sha}
        assert chapters <= set(cpu.chapter), \
            f"the repro log of {sha} lacks chapters {sorted(chapters - set(cpu.chapter))}"
        if sha != book:
            assert machines[sha] == machines[book], \
                f"{sorted(chapters)} recorded on {sorted(machines[sha])}, the book on {sorted(machines[book])}"
            book_cpu = logs[book][logs[book].device == "cpu"]
            assert cpu[cpu.chapter.isin(chapters)].finished.min() > book_cpu.finished.max(), \
                f"{sorted(chapters)} at {sha} were not recorded after the book's recording ({book})"
    return book, commit_of


def test_the_cpu_tables_come_from_clean_commits_whose_logs_are_committed():
    """One commit for the book's CPU recording; a chapter re-recorded later at its own."""
    tables = cpu_tables()
    assert all(tables.values()), [chapter for chapter, dfs in tables.items() if not dfs]
    book, commit_of = check_cpu_commits(tables, committed_repro_logs())
    assert set(commit_of) == set(RECORDED)
    assert sum(sha == book for sha in commit_of.values()) > len(RECORDED) / 2


def _table(sha: str, machine: str = "Xeon (AVX512)") -> pd.DataFrame:
    return pd.DataFrame({"git_sha": [sha, sha], "device_name": [machine, machine]})


def _log(chapters: list[str], finished: str) -> pd.DataFrame:
    return pd.DataFrame({"chapter": chapters, "device": "cpu", "seconds": "1.0",
                         "finished": finished})


def test_a_chapter_rerecorded_later_passes_and_a_mixed_or_unlogged_one_does_not():
    book = {"01": [_table("aaaaaaa")], "02": [_table("aaaaaaa")],
            "13": [_table("aaaaaaa"), _table("aaaaaaa")]}
    logs = {"aaaaaaa": _log(["01", "02", "13"], "2026-11-29T07:00:00Z")}
    assert check_cpu_commits(book, logs) == ("aaaaaaa", dict.fromkeys(book, "aaaaaaa"))
    # Chapter 13 alone re-recorded later on the same machine, with its own committed log.
    later = {**book, "13": [_table("bbbbbbb"), _table("bbbbbbb")]}
    later_logs = {**logs, "bbbbbbb": _log(["13"], "2026-12-01T07:00:00Z")}
    assert check_cpu_commits(later, later_logs)[1]["13"] == "bbbbbbb"
    failing = {
        "not one commit": ({**book, "13": [_table("aaaaaaa"), _table("bbbbbbb")]}, later_logs),
        "not committed": (later, logs),
        "lacks chapters": (later, {**logs, "bbbbbbb": _log(["12"], "2026-12-01T07:00:00Z")}),
        "uncommitted code": ({**book, "13": [_table("bbbbbbb-dirty")]},
                             {**logs, "bbbbbbb-dirty": _log(["13"], "2026-12-01T07:00:00Z")}),
        "recorded on": ({**book, "13": [_table("bbbbbbb", "EPYC (AVX2)")]}, later_logs),
        "not recorded after": (later, {**logs, "bbbbbbb": _log(["13"], "2026-11-01T07:00:00Z")}),
        "no commit carries most": ({"01": [_table("aaaaaaa")], "13": [_table("bbbbbbb")]},
                                   later_logs),
    }
    for message, (tables, committed) in failing.items():
        with pytest.raises(AssertionError, match=message):
            check_cpu_commits(tables, committed)


def test_every_table_names_its_cpu_and_instruction_set_once():
    """Chapter 07's timelines carry the CPU's label as written; read back, it is not labelled
    a second time ("Intel(R) Xeon(R) Processor (AVX512) (AVX512)")."""
    from miniinfer.book.results import RESULTS

    for path in sorted(RESULTS.rglob("cpu-*.csv*")):
        names = read_results(path).get("device_name")
        if names is not None:
            assert not names.str.contains(r"\(\w+\) \(\w+\)$").any(), path.name
