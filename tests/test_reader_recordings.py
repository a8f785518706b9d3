"""A reader's own `make chapter-NN` never changes the book: its recordings go to data/yours/, the
book's text and tables read data/results/ only, and the book's own tables are recorded from a
clean commit."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from miniinfer.bench import devices
from miniinfer.book import results_markdown
from miniinfer.book.chapters import CHAPTERS
from miniinfer.book.overview import CHAPTERS_DIR
from miniinfer.book.results import RESULTS, read_results, recorded_results, recorded_runs
from miniinfer.core.errors import MiniInferError
from miniinfer.lab.recordings import results_path


def book_texts() -> dict[str, str]:
    """Everything the book prints from its recordings without running a model."""
    texts = {f"chapter {n}": (CHAPTERS_DIR / ch.notebook).read_text() for n, ch in CHAPTERS.items()}
    texts["results"] = results_markdown()
    texts["runs"] = recorded_runs().to_csv()
    texts["ch01 tables"] = recorded_results("01").to_csv()
    return texts


@pytest.fixture
def readers_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "YOURS_DIR", tmp_path / "yours")
    monkeypatch.delenv(devices.FOR_BOOK_ENV, raising=False)
    return tmp_path / "yours"


def test_a_readers_recording_goes_to_their_folder_and_changes_no_text(readers_folder):
    before = book_texts()
    # A reader's chapter-01 run on a machine the book has not seen, written where `make
    # chapter-01` writes it, with the empty measurements that once printed "nan%".
    path = results_path("01", torch.device("cpu"))
    assert path.is_relative_to(readers_folder) and not path.is_relative_to(RESULTS)
    reference = read_results(next(iter(sorted((RESULTS / "ch01").glob("cpu-*.csv")))))
    fake = reference.assign(device_name="A Reader's Laptop CPU", isa="AVX2", pct_of_hf=float("nan"),
                            pct_of_hf_min=float("nan"), pct_of_hf_max=float("nan"))
    path.parent.mkdir(parents=True)
    fake.to_csv(path, index=False)
    devices.write_device(devices.DeviceSpeed("cpu-a-readers-laptop", "A Reader's Laptop CPU", 9.9,
                                             99.0, 2, "test", "2026-11-29", "AVX2"),
                         devices.recording_root() / "devices.csv")
    after = book_texts()
    assert after == before
    assert "nan%" not in after["results"] and "A Reader's Laptop" not in after["ch01 tables"]
    # The book's device table is untouched; the reader's device is in their own.
    assert devices.DEVICES_CSV.read_text().count("cpu-a-readers-laptop") == 0
    assert "cpu-a-readers-laptop" in (readers_folder / "devices.csv").read_text()


def test_a_readers_notebook_run_goes_beside_their_recordings_not_over_the_book(tmp_path,
                                                                                monkeypatch):
    """`make chapter-NN` executes the notebook; only `--for-book` writes it over the stored
    one, which is the book."""
    import nbclient

    from miniinfer.lab import repro

    monkeypatch.setattr(repro, "YOURS_DIR", tmp_path / "yours")
    executed = []
    monkeypatch.setattr(nbclient.NotebookClient, "execute",
                        lambda self: executed.append(self.nb) or self.nb)
    stored = (CHAPTERS_DIR / CHAPTERS["14"].notebook).read_bytes()
    repro.execute_notebook("14")
    assert executed and (CHAPTERS_DIR / CHAPTERS["14"].notebook).read_bytes() == stored
    yours = tmp_path / "yours" / "notebooks" / CHAPTERS["14"].notebook
    assert yours.exists() and repro.executed_notebook_path("14", False) == yours
    assert repro.executed_notebook_path("14", True) == CHAPTERS_DIR / CHAPTERS["14"].notebook


def test_a_recording_for_the_book_goes_to_the_books_folder(readers_folder, monkeypatch):
    monkeypatch.setenv(devices.FOR_BOOK_ENV, "1")
    assert results_path("01", torch.device("cpu")).is_relative_to(RESULTS)


def test_the_book_is_recorded_from_a_clean_commit_only(readers_folder, monkeypatch):
    from miniinfer.lab import repro

    monkeypatch.setattr(repro, "uncommitted_changes", lambda: ["miniinfer/engines/naive.py"])
    with pytest.raises(MiniInferError, match="uncommitted changes: miniinfer/engines/naive.py"):
        repro.reproduce("01", for_book=True)
    assert devices.recording_root() == readers_folder  # nothing switched to the book's folder


def test_a_recordings_own_outputs_do_not_make_the_tree_dirty(monkeypatch):
    from miniinfer.lab import repro

    status = (" M data/results/ch01/cpu-intel-xeon-avx512.csv\n M chapters/01_naive_hf_decode.ipynb\n"
              " M miniinfer/book/plans.py\n?? notes.txt\n")
    monkeypatch.setattr(repro.subprocess, "run",
                        lambda *a, **k: type("R", (), {"stdout": status})())
    assert repro.uncommitted_changes() == ["miniinfer/book/plans.py", "notes.txt"]


def test_dry_run_estimates_from_the_last_logged_run(tmp_path, monkeypatch):
    from miniinfer.lab import repro

    monkeypatch.setattr(repro, "REPRO_LOGS", tmp_path)
    repro.log_chapter(tmp_path / "repro-abc1234.csv", "01", torch.device("cpu"), 123.4,
                      notebook=False)
    plans = repro.reproduce_all(["01", "02"], device="cpu", dry_run=True)
    assert plans[0].logged and plans[0].estimate_s == 123.4
    assert not plans[1].logged  # no logged run: the cost model's estimate
    log = pd.read_csv(tmp_path / "repro-abc1234.csv")
    assert log.chapter.tolist() == [1] and log.notebook.tolist() == ["no"]


def test_the_dry_runs_estimate_is_the_most_recently_finished_run_of_a_chapter(tmp_path):
    from miniinfer.lab.repro import last_logged_seconds

    header = "chapter,device,seconds,notebook,finished\n"
    # Named so that the older log sorts last, and written last: neither may decide.
    (tmp_path / "repro-bbbbbbb.csv").write_text(header + "14,cpu,1123.1,no,2026-12-03T16:34:16Z\n")
    (tmp_path / "repro-ccccccc.csv").write_text(header + "14,cpu,424.2,no,2026-11-29T16:29:18Z\n"
                                                "13,cpu,87.5,no,2026-11-29T07:47:56Z\n")
    assert last_logged_seconds(tmp_path) == {("14", "cpu"): 1123.1, ("13", "cpu"): 87.5}


def test_your_recordings_are_this_devices_files_in_the_readers_folder_and_none_for_the_book(
        readers_folder, monkeypatch, capsys):
    """The chapters' "your machine" cells: the reader's files for this device, a line saying
    how to record them when there are none, and none in the book's sitting (whose recordings
    land in data/results and are the reference the chapter already shows)."""
    from miniinfer.book import your_recordings

    assert your_recordings("13", "cpu-x*.csv") == []
    assert capsys.readouterr().out == \
        "no recording of yours yet (cpu-x*.csv): make chapter-13 records one\n"
    (readers_folder / "ch13").mkdir(parents=True)
    mine = readers_folder / "ch13" / "cpu-x-quality.csv"
    for path in (mine, readers_folder / "ch13" / "cpu-y.csv"):
        path.write_text("a\n1\n")
    assert your_recordings("13", "cpu-x*.csv") == [mine] and capsys.readouterr().out == ""
    monkeypatch.setenv(devices.FOR_BOOK_ENV, "1")
    assert any((RESULTS / "ch13").glob("cpu-*.csv"))
    assert your_recordings("13", "cpu-*.csv") == []
