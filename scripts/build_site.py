"""`make book`: the book as a static website, from the notebooks as they are stored.

Nothing is executed: every page shows the outputs and figures its notebook was last saved with.
The pages follow the chapter registry (``miniinfer.book.chapters.CHAPTERS``): a chapter added
there gets a page and a place in the navigation with no change here, and a registered chapter
whose notebook is missing stops the build with its name.

The steps: stage a Sphinx source tree under ``build/site-src`` (an ``index.md`` that includes
the current ``README.md`` and holds the chapter table of contents, and a copy of each registered
notebook with a banner naming its file and its ``make chapter-NN``, and its solution cells marked
to render collapsed), then run Sphinx (``site/conf.py``) into ``build/site``.

    python scripts/build_site.py            # stage and build
    python scripts/build_site.py --stage    # stage only
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_registry():
    """miniinfer/book/chapters.py, read on its own: it is data only, and importing it through
    the package would import torch (seconds) for nothing."""
    name = "_miniinfer_chapter_registry"
    spec = importlib.util.spec_from_file_location(name, ROOT / "miniinfer" / "book" / "chapters.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


CHAPTERS = load_registry().CHAPTERS

CONF_DIR = ROOT / "site"
STAGE_DIR = ROOT / "build" / "site-src"
OUT_DIR = ROOT / "build" / "site"
CHAPTERS_DIR = ROOT / "chapters"

# A solution cell is tagged `solution`; Jupyter's own "input collapsed" flag
# (metadata.jupyter.source_hidden) is honoured too.
SOLUTION_TAG = "solution"
SOLUTION_PROMPTS = {"code_prompt_show": "Show the solution", "code_prompt_hide": "Hide the solution"}


class MissingNotebook(SystemExit):
    """A registered chapter has no notebook under chapters/."""


def chapter_pages() -> list[tuple[str, str, str]]:
    """(number, docname, navigation title) of every registered chapter, in registry order."""
    return [(ch.number, f"chapters/{ch.slug}", f"{ch.number} · {ch.title}")
            for ch in CHAPTERS.values()]


def toc_markdown() -> str:
    """The site's table of contents: a hidden MyST toctree with one entry per registered chapter
    (the sidebar shows it as the chapter table)."""
    lines = ["```{toctree}", ":hidden:", ":caption: Chapters", ""]
    lines += [f"{title} <{docname}>" for _, docname, title in chapter_pages()]
    lines.append("```")
    return "\n".join(lines) + "\n"


def index_markdown() -> str:
    """The front page: README.md, included (read at build time, never copied), then the toc."""
    readme = Path("..") / ".." / "README.md"  # relative to build/site-src/index.md
    return (f"```{{include}} {readme.as_posix()}\n"
            # README's images, relative to the repository root (links to repository files are
            # resolved by site/conf.py).
            ":relative-images:\n"
            "```\n\n" + toc_markdown())


def _mark_solutions(cell: dict) -> None:
    """Solution cells render collapsed: a code cell behind one "Show the solution" toggle (its
    code and its outputs), a markdown cell inside a <details> element (unless it already is)."""
    meta = cell.setdefault("metadata", {})
    tags = list(meta.get("tags", []))
    source_hidden = bool(meta.get("jupyter", {}).get("source_hidden"))
    outputs_hidden = bool(meta.get("jupyter", {}).get("outputs_hidden"))
    if cell["cell_type"] == "code":
        if SOLUTION_TAG in tags:
            tags.append("hide-cell")
            meta["mystnb"] = {**SOLUTION_PROMPTS, **meta.get("mystnb", {})}
        else:
            if source_hidden:
                tags.append("hide-input")
            if outputs_hidden:
                tags.append("hide-output")
        if tags:
            meta["tags"] = tags
    elif cell["cell_type"] == "markdown" and (SOLUTION_TAG in tags or source_hidden):
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if src.lstrip().startswith("<details"):
            return  # already behind its own toggle
        cell["source"] = ('<details class="solution">\n<summary>Show the solution</summary>\n\n'
                          f"{src}\n\n</details>\n")


def _banner(number: str, slug: str) -> str:
    # The download link is the notebook in chapters/ itself (Sphinx copies it into the site).
    return (f"```{{admonition}} This chapter's notebook\n"
            f":class: tip notebook-banner\n"
            f"This page is {{download}}`chapters/{slug}.ipynb <../../../chapters/{slug}.ipynb>` "
            f"as last executed and stored (nothing is re-run to build the site). Open it in "
            f"JupyterLab with `make lab`, or run it on your machine, recording your own results, "
            f"with `make chapter-{number}`.\n"
            f"```\n")


def _with_banner(cells: list[dict], number: str, slug: str) -> None:
    """The banner goes right under the chapter's heading (the first line of the first markdown
    cell that is one), or first of all when there is none."""
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        head, _, rest = src.partition("\n")
        if head.startswith("# "):
            cell["source"] = f"{head}\n\n{_banner(number, slug)}\n{rest}"
            return
        break
    cells.insert(0, {"cell_type": "markdown", "id": "notebook-banner", "metadata": {},
                     "source": _banner(number, slug)})


def stage_notebook(number: str, slug: str, src: Path, dest: Path) -> None:
    nb = json.loads(src.read_text(encoding="utf-8"))
    cells = [copy.deepcopy(c) for c in nb["cells"]]
    for cell in cells:
        _mark_solutions(cell)
    _with_banner(cells, number, slug)
    nb["cells"] = cells
    dest.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")


def stage(stage_dir: Path = STAGE_DIR) -> list[Path]:
    """Write the Sphinx source tree; fail, naming them, if registered chapters lack notebooks."""
    missing = [f"chapter {ch.number}: chapters/{ch.notebook}" for ch in CHAPTERS.values()
               if not (CHAPTERS_DIR / ch.notebook).is_file()]
    if missing:
        raise MissingNotebook("build_site: registered chapters without a notebook (register a "
                              "chapter in miniinfer/book/chapters.py only with its notebook):\n  "
                              + "\n  ".join(missing))
    registered = {ch.notebook for ch in CHAPTERS.values()}
    for extra in sorted(p.name for p in CHAPTERS_DIR.glob("*.ipynb") if p.name not in registered):
        print(f"build_site: chapters/{extra} is not in the chapter registry; it gets no page",
              file=sys.stderr)
    if stage_dir.exists():
        shutil.rmtree(stage_dir)
    (stage_dir / "chapters").mkdir(parents=True)
    (stage_dir / "index.md").write_text(index_markdown(), encoding="utf-8")
    written = [stage_dir / "index.md"]
    for ch in CHAPTERS.values():
        dest = stage_dir / "chapters" / ch.notebook
        stage_notebook(ch.number, ch.slug, CHAPTERS_DIR / ch.notebook, dest)
        written.append(dest)
    return written


def build(stage_dir: Path = STAGE_DIR, out_dir: Path = OUT_DIR) -> None:
    stage(stage_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    # -E: read every source again (no stale environment); -W is not used: the notebooks' own
    # prose may carry warnings that are not the site's to fail on; they are printed.
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-q", "-c", str(CONF_DIR),
           "-d", str(stage_dir.parent / "site-doctrees"), str(stage_dir), str(out_dir)]
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", action="store_true", help="stage the sources only")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    if args.stage:
        stage()
        print(f"build_site: staged {STAGE_DIR.relative_to(ROOT)}")
        return 0
    build()
    size = sum(p.stat().st_size for p in OUT_DIR.rglob("*") if p.is_file())
    print(f"build_site: {OUT_DIR.relative_to(ROOT)}/index.html, {len(CHAPTERS)} chapters, "
          f"{size / 2**20:.1f} MiB, in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
