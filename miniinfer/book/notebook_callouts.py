"""The opening callouts as the notebooks carry them: read the one in a notebook's first cell,
and write each chapter's current one there (:mod:`.callouts` computes them)."""

from __future__ import annotations

import json

from .callouts import CPU_LINES, callout


def notebook_callout(path) -> str | None:
    """The callout block in a notebook's first cell (the lines after the title that start with
    ``>``), or None."""
    cells = json.loads(path.read_text())["cells"]
    first = "".join(cells[0]["source"]).splitlines()
    block = []
    for line in first[1:]:
        if line.startswith(">"):
            block.append(line)
        elif block:
            break
    return "\n".join(block) if block else None


def update_notebooks() -> list[str]:
    """Write each chapter's current callout into its notebook's first cell, right under the
    title (replacing the one there); returns the chapters whose callout changed."""
    import nbformat

    from .chapters import CHAPTERS
    from .overview import CHAPTERS_DIR

    changed = []
    for number, chapter in CHAPTERS.items():
        if number not in CPU_LINES:
            continue
        path = CHAPTERS_DIR / chapter.notebook
        nb = nbformat.read(path, as_version=4)
        lines = nb.cells[0].source.splitlines()
        title, rest = lines[0], lines[1:]
        old = notebook_callout(path)
        if old is not None:
            start = rest.index(old.splitlines()[0])
            rest = rest[:start] + rest[start + len(old.splitlines()):]
        while rest and not rest[0].strip():
            rest = rest[1:]
        new = callout(number)
        if new != old:
            nb.cells[0].source = "\n".join([title, "", new, "", *rest])
            nbformat.write(nb, path)
            changed.append(number)
    return changed
