"""Sphinx configuration of the book's website (`make book`; the sources are staged by
scripts/build_site.py under build/site-src, the site is written to build/site).

Why Sphinx + myst-nb + sphinx-book-theme, not Jupyter Book 2: Jupyter Book 2 is a front end to
the Node-based MyST tool chain, whose HTML theme is a separate web application fetched at build
time and whose pages load their content with JavaScript; this machine, a reader's and CI reach
PyPI only, and the site must build and be read with nothing fetched. myst-nb, Sphinx and
sphinx-book-theme install from PyPI, render a notebook's stored outputs without a kernel
(nb_execution_mode = "off"), ship their fonts, icons, scripts and a client-side search index
inside the site, and produce plain HTML files that open from any static server. What would reach
a CDN: the ipywidgets loader, switched off below (the notebooks' tqdm bars show as text), and
MathJax, which Sphinx adds only to a page with math (none has; scripts/check_site.py fails on any
request that leaves the local server, so a chapter that adds math will say so).
"""

from __future__ import annotations

project = "miniinfer"
author = "the miniinfer authors"
copyright = "the miniinfer authors"

extensions = ["myst_nb"]
root_doc = "index"
exclude_patterns = ["**.ipynb_checkpoints"]

# The notebooks as stored: never executed here.
nb_execution_mode = "off"
# No require.js / @jupyter-widgets from a CDN; a widget output falls back to its text.
nb_ipywidgets_js: dict = {}
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None),
                              ("html", "application/vnd.jupyter.widget-state+json", None)]
nb_merge_streams = True
# Wide tables (per-engine results) scroll inside their cell instead of running off the page.
nb_render_markdown_format = "commonmark"

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]

html_theme = "sphinx_book_theme"
html_title = "miniinfer: an LLM inference engine, one optimisation at a time"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    # Nothing that reaches another site: no repository, launch or issue buttons.
    "use_repository_button": False,
    "use_issues_button": False,
    "use_fullscreen_button": True,
}
# The page's own source is not copied (it would be a second copy of every notebook): the banner
# on each chapter links the notebook file itself.
html_copy_source = False
# The header bar already has the search field; the sidebar keeps the title and the chapters.
html_sidebars = {"**": ["navbar-logo.html", "icon-links.html", "sbt-sidebar-nav.html"]}
# The theme's script reads the colour mode from localStorage or this default; left unset, a first
# visit logs "Got invalid theme mode: ." to the console (caught by scripts/check_site.py).
html_context = {"default_mode": "auto"}
html_show_sourcelink = False
html_last_updated_fmt = None



# Links to files of the repository that are not pages (README's data/results/.../RECORDINGS.md, a
# chapter's ../miniinfer/...): the file is copied into the site under _repo/ as it is stored, and
# the link points there, so no link of the site leads nowhere.
from pathlib import Path  # noqa: E402

from docutils import nodes  # noqa: E402
from sphinx import addnodes  # noqa: E402
from sphinx.transforms.post_transforms import SphinxPostTransform  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REPO_FILES_DIR = "_repo"


def _repo_file(docname: str, target: str) -> Path | None:
    """The repository file a link of this page names, if it is one. index.md stands for README.md
    (at the root); the staged chapters/ mirrors the repository's chapters/."""
    if "://" in target or target.startswith(("#", "mailto:")):
        return None
    base = REPO / Path(docname).parent
    path = (base / target.split("#", 1)[0]).resolve()
    if not path.is_file() or REPO not in path.parents or (REPO / "build") in path.parents:
        return None
    return path


class RepoFileLinks(SphinxPostTransform):
    default_priority = 8  # before myst's resolver (9) warns about them

    def run(self, **kwargs) -> None:
        files = _REPO_FILES
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("reftype") != "myst" or node.get("refdomain") == "doc":
                continue
            path = _repo_file(node.get("refdoc", self.env.docname), node["reftarget"])
            if path is None:
                continue
            rel = path.relative_to(REPO).as_posix()
            files.add(rel)
            depth = self.env.docname.count("/")
            ref = nodes.reference("", "", internal=False,
                                  refuri="../" * depth + f"{REPO_FILES_DIR}/{rel}")
            ref += node[0].deepcopy() if node.children else nodes.literal(rel, rel)
            node.replace_self(ref)


_REPO_FILES: set[str] = set()


def _copy_repo_files(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    import shutil

    for rel in sorted(_REPO_FILES):
        dest = Path(app.outdir) / REPO_FILES_DIR / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, dest)


def setup(app):
    app.add_post_transform(RepoFileLinks)
    app.connect("build-finished", _copy_repo_files)
