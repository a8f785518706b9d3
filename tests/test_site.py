"""The book's website (`make book`, `make book-check`): its table of contents follows the chapter
registry, solutions render collapsed, and the built site passes the browser check."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miniinfer.book.chapters import CHAPTERS, Chapter

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_site = _load("build_site")


def test_toc_has_a_page_for_every_registered_chapter():
    toc = build_site.toc_markdown()
    entries = [line for line in toc.splitlines() if line.endswith(">")]
    assert [e.rsplit("<", 1)[1].rstrip(">") for e in entries] == \
        [f"chapters/{ch.slug}" for ch in CHAPTERS.values()]
    for ch in CHAPTERS.values():
        assert f"{ch.number} · {ch.title} <chapters/{ch.slug}>" in toc
    assert build_site.index_markdown().startswith("```{include} ../../README.md")


def test_a_new_chapter_gets_a_page_and_one_without_a_notebook_stops_the_build(monkeypatch,
                                                                              tmp_path):
    extra = Chapter("99", "99_not_written_yet", "A chapter with no notebook", recording="none")
    monkeypatch.setattr(build_site, "CHAPTERS", {**CHAPTERS, "99": extra})
    assert "99 · A chapter with no notebook <chapters/99_not_written_yet>" in \
        build_site.toc_markdown()
    with pytest.raises(build_site.MissingNotebook, match="chapter 99: chapters/99_not_written"):
        build_site.stage(tmp_path / "src")
    assert not (tmp_path / "src").exists()  # nothing staged


def _nb(cells: list[dict]) -> dict:
    return {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "language": "python",
                                                        "display_name": "Python 3"},
                                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def _md(i: int, src: str, **meta) -> dict:
    return {"cell_type": "markdown", "id": f"m{i}", "metadata": meta, "source": src}


def _code(i: int, src: str, text: str, **meta) -> dict:
    return {"cell_type": "code", "id": f"c{i}", "metadata": meta, "execution_count": i,
            "source": src, "outputs": [{"output_type": "stream", "name": "stdout",
                                        "text": text}]}


FIXTURE = _nb([
    _md(0, "# Chapter 98 — Fixture\n\nIntro."),
    _md(1, "## Exercises\n\n1. Sum the list."),
    _code(2, "print(sum([1, 2]))  # SOLUTION-CODE", "SOLUTION-OUTPUT\n", tags=["solution"]),
    _code(3, "print('collapsed')  # HIDDEN-SOURCE", "shown\n", jupyter={"source_hidden": True}),
    _md(4, "The answer, in prose: **SOLUTION-PROSE**.", tags=["solution"]),
    _md(5, "<details>\n<summary>A hint</summary>\n\nTry **HINT-BOLD**.\n\n</details>"),
    _code(6, "print('plain')  # PLAIN-CODE", "plain\n"),
    _md(7, "<details>\n<summary>Solutions</summary>\n\n1. **OWN-DETAILS**\n\n</details>",
        tags=["solution"]),
])


def test_solution_cells_are_marked_to_render_collapsed(tmp_path):
    src = tmp_path / "98_fixture.ipynb"
    src.write_text(json.dumps(FIXTURE))
    build_site.stage_notebook("98", "98_fixture", src, tmp_path / "out.ipynb")
    cells = json.loads((tmp_path / "out.ipynb").read_text())["cells"]
    assert "make chapter-98" in cells[0]["source"] and \
        cells[0]["source"].startswith("# Chapter 98")
    assert "hide-cell" in cells[2]["metadata"]["tags"]
    assert cells[2]["metadata"]["mystnb"]["code_prompt_show"] == "Show the solution"
    assert cells[3]["metadata"]["tags"] == ["hide-input"]
    assert cells[4]["source"].startswith('<details class="solution">')
    assert cells[5] == FIXTURE["cells"][5] and cells[6] == FIXTURE["cells"][6]
    assert cells[7]["source"] == FIXTURE["cells"][7]["source"]  # not wrapped twice


def test_solutions_and_details_render_collapsed_in_html(tmp_path):
    """A one-page build with the site's own configuration (a few seconds)."""
    pytest.importorskip("myst_nb", reason="the site's tools are not installed (make book-setup)")
    src = tmp_path / "src"
    (src / "chapters").mkdir(parents=True)
    nb = tmp_path / "98_fixture.ipynb"
    nb.write_text(json.dumps(FIXTURE))
    build_site.stage_notebook("98", "98_fixture", nb, src / "chapters" / "98_fixture.ipynb")
    (src / "index.md").write_text("# Fixture\n\n```{toctree}\nchapters/98_fixture\n```\n")
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-c",
                    str(ROOT / "site"), str(src), str(tmp_path / "out")], check=True)
    html = (tmp_path / "out" / "chapters" / "98_fixture.html").read_text()

    def enclosing_details(marker: str) -> str:
        """The opening tag of the innermost <details> still open where ``marker`` is."""
        before = html[:html.index(marker)]
        opened = before.rfind("<details")
        assert opened > before.rfind("</details>"), f"{marker} is not inside a <details>"
        return before[opened:before.index(">", opened) + 1]

    for marker in ("SOLUTION-CODE", "SOLUTION-OUTPUT", "HIDDEN-SOURCE", "SOLUTION-PROSE",
                   "HINT-BOLD", "OWN-DETAILS"):
        assert " open" not in enclosing_details(marker), marker
    assert "Show the solution" in html
    assert "<strong>HINT-BOLD</strong>" in html  # markdown inside <details> is rendered
    before = html[:html.index("PLAIN-CODE")]
    assert before.rfind("<details") < before.rfind("</details>")  # a plain cell stays open


SITE = ROOT / "build" / "site"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


@pytest.mark.skipif(not (SITE / "index.html").is_file(),
                    reason="the site is not built (make book; make book-check runs this check)")
@pytest.mark.skipif(not Path(CHROMIUM).is_file() or shutil.which(CHROMIUM) is None,
                    reason=f"no chromium at {CHROMIUM} (apt-get install chromium)")
def test_built_site_in_a_browser():
    pytest.importorskip("playwright", reason="playwright is not installed (make book-setup)")
    check_site = _load("check_site")
    errors = check_site.check(SITE, CHROMIUM, log=lambda *_: None)
    assert errors == []
    assert (ROOT / "build" / "site-check" / "ch01.png").stat().st_size > 0
