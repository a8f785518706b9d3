"""Each stage as a diff of the one before (chapters 02-09): the methods its class defines, against what it inherits."""

from __future__ import annotations

import difflib
import inspect
import sys
import textwrap
from dataclasses import dataclass

from .chapters import chapter_of_stage


@dataclass(frozen=True, slots=True)
class MethodChange:
    """One method a stage defines: ``overrides`` one it inherits (``diff`` against the
    inherited source) or ``adds`` a new one (``diff`` is all additions)."""
    name: str
    kind: str  # "overrides" | "adds"
    inherited_from: str | None  # the class whose version it replaces
    diff: str  # unified diff, full method as context


@dataclass(frozen=True, slots=True, repr=False)
class StageDiff:
    """What a stage's class changes against its parent class, read from the package's source.
    Jupyter renders it as HTML (one diff block per method); ``str`` gives plain text."""
    stage: str
    cls: type
    parent: type
    changes: tuple[MethodChange, ...]
    module_extras: tuple[str, ...]  # other classes and functions its module defines
    # The engine settings the stage sets on top of its parent's (a serving stage is a preset
    # of one config: chapter 11's compiled stage is forward="compiled").
    settings: tuple[tuple[str, object], ...] = ()

    def header(self) -> str:
        parent_stage = getattr(self.parent, "name", None)
        parent = (f"`{parent_stage}` ({self.parent.__name__}, chapter "
                  f"{chapter_of_stage(parent_stage) or '?'})") \
            if parent_stage else f"`{self.parent.__name__}`"
        overrides = [c.name for c in self.changes if c.kind == "overrides"]
        adds = [c.name for c in self.changes if c.kind == "adds"]
        stage = getattr(self.cls, "name", None)
        chapter = (chapter_of_stage(stage) if stage else None) or "?"
        lines = [f"`{self.stage}` ({self.cls.__name__} in `{self.cls.__module__}`, chapter "
                 f"{chapter}) subclasses {parent}."]
        if self.settings:
            lines.append("It sets " + ", ".join(f"{k}={v!r}" for k, v in self.settings)
                         + " in the engine's config.")
        lines.append(f"It overrides {_names(overrides)} and adds {_names(adds)}; everything "
                     f"else is inherited.")
        if self.module_extras:
            lines.append(f"Its module also defines {_names(list(self.module_extras))}.")
        return " ".join(lines)

    def _repr_html_(self) -> str:
        """A block per method, lines coloured as in a code review; new methods start folded."""
        from html import escape

        colours = {"+": "#e6ffec", "-": "#ffebe9", "@": "#ddf4ff"}
        parts = [f"<p>{escape(self.header()).replace('`', '')}</p>"]
        for change in self.changes:
            lines = "".join(
                f'<span style="display:block;background:{colours.get(line[:1], "transparent")}">'
                f"{escape(line) or '&nbsp;'}</span>"
                for line in change.diff.splitlines()[2:])  # the ---/+++ names are in the summary
            verb = (f"overrides {change.inherited_from}.{change.name}"
                    if change.kind == "overrides" else "new method")
            parts.append(f"<details{' open' if change.kind == 'overrides' else ''}><summary>"
                         f"<code>{escape(change.name)}</code> ({escape(verb)})</summary>"
                         f'<pre style="font-size:85%;line-height:1.25">{lines}</pre></details>')
        return "\n".join(parts)

    def __str__(self) -> str:
        return "\n\n".join([self.header(), *(c.diff for c in self.changes)])

    __repr__ = __str__  # the plain-text view where HTML is not shown


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else "nothing"


def class_diff(cls: type, stage: str | None = None) -> StageDiff:
    """:func:`show_diff` for any class: every method it defines, diffed against the version
    its parent would have given it (found along the parent's MRO), with the whole method as
    context so the reader sees it in full; a method new to it is all additions."""
    parent = cls.__mro__[1]
    changes = []
    for name, member in vars(cls).items():
        func = _function_of(member)
        if func is None:
            continue
        source = textwrap.dedent(inspect.getsource(func)).splitlines()
        owner = next((base for base in parent.__mro__ if name in vars(base)), None)
        if owner is None:
            before, kind = [], "adds"
        else:
            inherited = _function_of(vars(owner)[name])
            before = textwrap.dedent(inspect.getsource(inherited)).splitlines() \
                if inherited is not None else []
            kind = "overrides"
        diff = difflib.unified_diff(before, source,
                                    f"{owner.__name__}.{name}" if owner else "(new)",
                                    f"{cls.__name__}.{name}", n=max(len(before), len(source)),
                                    lineterm="")
        changes.append(MethodChange(name, kind, owner.__name__ if owner else None,
                                    "\n".join(diff)))
    module = sys.modules[cls.__module__]
    extras = tuple(name for name, obj in vars(module).items()
                   if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj is not cls
                   and getattr(obj, "__module__", None) == module.__name__)
    preset, before = getattr(cls, "preset", {}), getattr(parent, "preset", {})
    settings = tuple((k, v) for k, v in preset.items() if before.get(k, object()) != v)
    return StageDiff(stage or getattr(cls, "name", cls.__name__), cls, parent, tuple(changes),
                     extras, settings)


def _function_of(member) -> object | None:
    """The function behind a class attribute (method, static/class method, property getter),
    None for data attributes such as ``name`` or ``summary``."""
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__
    if isinstance(member, property):
        return member.fget
    return member if inspect.isfunction(member) else None


def show_diff(stage: str) -> StageDiff:
    """The methods ``stage``'s class defines itself (``"stage:variant"`` names the stage's
    class too), each as a unified diff against the version it inherits. As a notebook cell's
    last line, Jupyter renders it as a diff block per method."""
    from ..engines import resolve_engine

    return class_diff(resolve_engine(stage)[0], stage)
