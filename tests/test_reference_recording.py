"""The book's CPU tables are one recording: one machine, one commit (issue 65)."""

from __future__ import annotations

from miniinfer.book.chapters import CHAPTERS, REFERENCE_DEVICES, reference_device
from miniinfer.book.repro import REPRO_LOGS, logged_seconds
from miniinfer.book.results import read_results, reference_files

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


def test_the_cpu_tables_come_from_one_clean_commit_whose_log_is_committed():
    commits: dict[str, set[str]] = {}
    for chapter in RECORDED:
        for path in cpu_reference_files(chapter):
            df = read_results(path)
            if "git_sha" in df:
                for sha in df.git_sha.dropna().unique():
                    commits.setdefault(sha, set()).add(f"{path.parent.name}/{path.name}")
    assert len(commits) == 1, {sha: sorted(files)[:3] for sha, files in commits.items()}
    (sha,) = commits
    assert not sha.endswith("-dirty")
    logged = logged_seconds(REPRO_LOGS / f"repro-{sha}.csv")
    assert {chapter for chapter, kind in logged if kind == "cpu"} >= set(RECORDED), \
        f"the repro log of {sha} lacks chapters"


def test_every_table_names_its_cpu_and_instruction_set_once():
    """Chapter 07's timelines carry the CPU's label as written; read back, it is not labelled
    a second time ("Intel(R) Xeon(R) Processor (AVX512) (AVX512)")."""
    from miniinfer.book.results import RESULTS

    for path in sorted(RESULTS.rglob("cpu-*.csv*")):
        names = read_results(path).get("device_name")
        if names is not None:
            assert not names.str.contains(r"\(\w+\) \(\w+\)$").any(), path.name
