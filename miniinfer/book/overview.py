"""Chapter 00's map of the book: the chapters, the stage classes as a tree, the package's modules."""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
from pathlib import Path

import pandas as pd

from ..bench.devices import REPO_ROOT
from .chapters import CHAPTERS, chapter_of_stage
from .results import recorded_devices

CHAPTERS_DIR = REPO_ROOT / "chapters"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def notebook_title(path: Path) -> str | None:
    """The notebook's first heading without its "Chapter NN —" prefix."""
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            first = "".join(cell["source"]).lstrip().splitlines()[0]
            return first.lstrip("# ").split(" — ", 1)[-1]
    return None


def chapter_table() -> pd.DataFrame:
    """Every chapter of the registry: what it adds (stages from the engine registry, with the
    module each lives in and its one-sentence summary) and which devices it is recorded on."""
    from ..engines import ENGINES

    rows = []
    for ch in CHAPTERS.values():
        modules = [ENGINES[s].__module__ for s in ch.stages] + [m for m in ch.modules
                                                                if _importable(m)]
        ideas = [f"`{s}`: {ENGINES[s].summary}" for s in ch.stages]
        rows.append({
            "chapter": ch.number,
            "title": ch.title,
            "notebook": ch.notebook,
            "stage": ", ".join(ch.stages) or "(none)",
            "modules": ", ".join(modules),
            "idea": "; ".join(ideas) or ch.idea,
            "recorded on": ", ".join(recorded_devices(ch.number)),
        })
    return pd.DataFrame(rows)


def stage_tree() -> str:
    """The engine classes as a tree of who subclasses whom, from the registry's classes."""
    from ..engines import ENGINES, Engine

    def label(cls: type) -> str:
        if cls is Engine:
            return f"Engine ({cls.__module__})"
        return (f"{cls.name}: {cls.__name__} ({cls.__module__}, "
                f"chapter {chapter_of_stage(cls.name)})")

    classes = list(ENGINES.values())
    lines: list[str] = []

    def walk(cls: type, prefix: str, last: bool, root: bool) -> None:
        lines.append(label(cls) if root else f"{prefix}{'└── ' if last else '├── '}{label(cls)}")
        children = [c for c in classes if c.__mro__[1] is cls]
        inner = "" if root else prefix + ("    " if last else "│   ")
        for i, child in enumerate(children):
            walk(child, inner, i == len(children) - 1, False)

    walk(Engine, "", True, True)
    return "\n".join(lines)


def package_map() -> pd.DataFrame:
    """Every module of the package, the chapter that adds it (per the chapter registry; "-" for
    what every chapter uses) and its docstring's first paragraph."""
    from ..engines import ENGINES

    chapter_of = {m: ch.number for ch in CHAPTERS.values() for m in ch.modules}
    chapter_of.update({ENGINES[s].__module__: ch.number
                       for ch in CHAPTERS.values() for s in ch.stages})
    package = importlib.import_module("miniinfer")
    rows = []
    for info in pkgutil.walk_packages(package.__path__, "miniinfer."):
        if info.name.endswith("__main__"):
            continue
        # The most specific entry wins: chapter 11's runner.compiled, not chapter 06's runner.
        owners = [m for m in chapter_of if info.name == m or info.name.startswith(m + ".")]
        owner = chapter_of[max(owners, key=len)] if owners else "-"
        doc = (importlib.import_module(info.name).__doc__ or "").strip()
        rows.append({"module": info.name, "chapter": owner,
                     "what it is": " ".join(doc.split("\n\n")[0].split())})
    return pd.DataFrame(rows).sort_values(["chapter", "module"], ignore_index=True)
