"""The package's shape: layers that import only from below, one chapter registry, a serving
engine that holds a model runner instead of inheriting a static-batch engine."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from miniinfer.book.chapters import CHAPTERS, chapters_markdown
from miniinfer.engines import ENGINES
from miniinfer.engines.continuous import ContinuousEngine
from miniinfer.engines.paged_loop import PagedLoopEngine

PACKAGE = Path(__file__).resolve().parents[1] / "miniinfer"
REPO = PACKAGE.parent
# From the bottom up: each layer may import only from the layers before it (and itself).
LAYERS = ("core", "runner", "engines", "server", "bench", "book", "cli")


def _imports() -> list[tuple[str, str]]:
    """(importing module, imported module) for every miniinfer import, at any depth of a file
    (imports inside functions count: a lazy import is still a dependency)."""
    edges = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        module = ".".join(parts[:-1] if path.name == "__init__.py" else parts)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("miniinfer"):
                continue
            if node.module is None:  # "from . import a, b": the modules a and b
                edges += [(module, f"{target}.{alias.name}") for alias in node.names]
            else:
                edges.append((module, target))
    return edges


def _layer(module: str) -> str | None:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else ""
    return "cli" if name in ("cli", "__main__") else name if name in LAYERS else None


def test_every_layer_imports_only_from_below():
    upward = [(a, b) for a, b in _imports()
              if _layer(a) and _layer(b) and LAYERS.index(_layer(b)) > LAYERS.index(_layer(a))]
    assert upward == []


def test_no_import_circle_between_modules():
    graph: dict[str, set[str]] = {}
    for a, b in _imports():
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            # "from .x import y" names the package; a module imports its own package's
            # __init__ only through it, which is not a circle of modules.
            if nxt == goal:
                return True
            if nxt not in seen and not goal.startswith(nxt + "."):
                seen.add(nxt)
                if reaches(nxt, goal, seen):
                    return True
        return False

    circles = [m for m in graph if reaches(m, m, set())]
    assert circles == []


def test_book_modules_stay_small():
    for path in (PACKAGE / "book").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path.name


def test_continuous_engine_inherits_no_static_batch_engine():
    assert PagedLoopEngine not in ContinuousEngine.__mro__
    for cls in (ENGINES["continuous"], ENGINES["prefix-cache"]):
        assert not any(issubclass(cls, ENGINES[s]) for s in
                       ("paged-loop", "paged-vectorized", "paged-prealloc", "paged-attention",
                        "async")), cls


def test_chapter_titles_live_only_in_the_registry_and_the_notebooks():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    for chapter in CHAPTERS.values():
        found = {f for f in tracked if f.endswith((".py", ".md", ".toml", ".txt", "Makefile"))
                 and chapter.title in (REPO / f).read_text(errors="replace")}
        assert found <= {"miniinfer/book/chapters.py"}, (chapter.number, found)


def test_readme_chapter_table_is_the_registrys():
    readme = (REPO / "README.md").read_text()
    assert chapters_markdown() in readme, "regenerate: python -m miniinfer chapters"


def test_makefile_targets_come_from_the_registry():
    # `make chapter-NN` is one pattern rule over `repro`, which reads the registry.
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^chapter-%:", makefile, re.M)
    assert not re.search(r"^chapter-\d\d:", makefile, re.M)
