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
LAYERS = ("core", "runner", "engines", "server", "bench", "book", "lab", "cli")


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
    # The book is what the notebooks display; what records them is the lab's.
    sizes = {path.name: len(path.read_text().splitlines()) for path in (PACKAGE / "book").glob("*.py")}
    assert all(lines <= 400 for lines in sizes.values()), sizes
    assert sum(sizes.values()) <= 2500, sum(sizes.values())


# A measured figure: a time, a rate or a share ("97 us", "106.6 tokens/s", "0.6x", "30%"), not
# a formula ("2 x layers"), a count of things or a size that is arithmetic (a model's bytes).
MEASURED = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:\s*(?:ms|us|µs|tok/s|tokens/s|GB/s|"
                      r"%|seconds)\b|x\b)")


def test_module_docstrings_say_why_not_how_fast():
    """Measured numbers belong in the notebooks and the lab notes, where their host is named."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if hits := [m.group(0) for m in MEASURED.finditer(doc)]:
            found[str(path.relative_to(REPO))] = hits
    assert not found, found
    assert MEASURED.search("took 97 us per layer") and MEASURED.search("0.4-0.6x its time")
    assert not MEASURED.search("2 x layers copies") and not MEASURED.search("210 projections")


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


def _runs_a_layer(loop: ast.For) -> bool:
    """Whether a loop's body runs a decoder layer's forward: calls its loop variable, an
    attention (``*attend*``) or a matmul (``*linear*``)."""
    target = ast.unparse(loop.target)
    for node in ast.walk(loop):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name == target or "attend" in name or "linear" in name:
                return True
    return False


def test_one_decoder_layer_loop():
    """The decoder layers are run by one loop, the model definition's (runner/model.py): the
    direct, compiled and sharded forwards all call it, so a new kind of weight or attention
    changes one place. (Chapters 02-05 loop over HF's KV cache layers, to copy K/V, not to
    run the layers.)"""
    loops = sorted(f"{path.relative_to(REPO)}:{node.lineno}"
             for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.For) and "layers" in ast.unparse(node.iter)
             and _runs_a_layer(node))
    assert loops == ["miniinfer/runner/model.py:" + str(_line_of("miniinfer/runner/model.py",
                                                                  "for layer in self.layers:"))]


def _line_of(relative: str, text: str) -> int:
    lines = (REPO / relative).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == text)


# HF's Llama/Qwen2 module attributes: reading one means walking HF's module tree.
HF_MODULE_ATTRIBUTES = {"self_attn", "mlp", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                        "up_proj", "down_proj", "input_layernorm", "post_attention_layernorm",
                        "embed_tokens", "rotary_emb"}


def test_runner_forwards_read_no_hf_modules_after_load():
    """Our model is built once from HF's state dict (``runner.model.load`` reads the rotary
    frequencies, the one thing not in it); after that no runner code walks HF's module tree.
    The ``registry`` forward runs HF's own modules by design and reads none of these either;
    the static stages of chapters 01-07 (engines/) run HF's modules and are not checked."""
    reads = []
    for path in (PACKAGE / "runner").glob("*.py"):
        tree = ast.parse(path.read_text())
        allowed = set()
        if path.name == "model.py":
            (load,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "load"]
            allowed = {id(node) for node in ast.walk(load)}
        reads += [f"{path.name}:{node.lineno} .{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in HF_MODULE_ATTRIBUTES
                  and id(node) not in allowed]
    assert reads == []
