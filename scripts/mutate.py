"""Mutation testing for one module: does a test selection notice when the code is subtly wrong?

Each mutant is one small change to the module (a comparison flipped ``<``/``<=``, a ``+ 1``
dropped, ``reversed(...)`` removed, a statement deleted, ...). For each, the selection runs
against a copy of the repository with only that change made; a mutant the selection still
passes on *survives*: either the change makes no difference (an equivalent mutant), or no test
looks at the state it breaks. Your working tree is never modified.

    python scripts/mutate.py miniinfer/core/scheduler.py --tests tests/test_scheduler.py
    python scripts/mutate.py miniinfer/core/prefix_cache.py --tests "tests/test_prefix_cache_policy.py" \\
        --within PrefixCacheBlockManager.free
    python scripts/mutate.py miniinfer/core/scheduler.py --list          # the mutants, nothing run
    python scripts/mutate.py miniinfer/core/prefix_cache.py --tests tests/test_prefix_cache_policy.py \\
        --change "reversed(self._table(request_id))" "self._table(request_id)"

``--change OLD NEW`` runs one hand-written mutant (the text OLD, which must occur once, becomes
NEW) instead of the generated ones: a quick way to check that a test catches a given bug.

The selection first runs once on the unchanged code with line tracing: a mutant on a line it
never executes is reported as NOT RUN without running it (it cannot be caught; ``--all`` runs
it anyway, for code that only runs in a child process). Each mutant's run is a fork of this
process with torch and transformers already imported, so a run costs the selection's own time
plus a few seconds; point ``--tests`` at the fast tests that should see the module's policy,
narrow with ``--within`` while you work, and rerun the survivors with ``--only``. (A ``-k`` in
``--tests`` filters every file named there: name tests by node id to mix files.)

Exit status: 0 when every mutant was caught, 1 when some survived or were not run, 2 when the
selection fails on the unchanged code.
"""

from __future__ import annotations

import argparse
import ast
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# What a test run needs from the repository; results are copied too, since some tests read them.
COPIED = ("miniinfer", "tests", "data", "pyproject.toml")

COMPARE_SWAPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
}
BINOP_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
}
CALL_SWAPS = {"min": "max", "max": "min", "popleft": "pop", "appendleft": "append",
              "any": "all", "all": "any"}


@dataclass(frozen=True, slots=True)
class Mutant:
    """Replace the source between (line, col) and (end_line, end_col) with ``text``."""

    line: int
    col: int
    end_line: int
    end_col: int
    text: str
    what: str
    where: str  # the enclosing function, e.g. Scheduler.schedule

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        start = sum(len(x) for x in lines[: self.line - 1]) + _byte_col(lines[self.line - 1],
                                                                           self.col)
        end = sum(len(x) for x in lines[: self.end_line - 1]) + _byte_col(
            lines[self.end_line - 1], self.end_col)
        return source[:start] + self.text + source[end:]


def _byte_col(line: str, col: int) -> int:
    """ast's columns count UTF-8 bytes; str indices count characters."""
    return len(line.encode("utf-8")[:col].decode("utf-8"))


def _span(node: ast.AST) -> tuple[int, int, int, int]:
    return node.lineno, node.col_offset, node.end_lineno, node.end_col_offset


def _skipped(node: ast.AST, parents: list[ast.AST]) -> bool:
    """Error messages, docstrings, annotations and type-checking imports: changing them
    changes no behaviour a test of the policy should see."""
    for parent in parents:
        if isinstance(parent, ast.JoinedStr | ast.Raise | ast.arg | ast.Assert):
            return True
        if isinstance(parent, ast.AnnAssign) and node is not parent.value \
                and not _inside(node, parent.value):
            return True
        if isinstance(parent, ast.If) and ast.unparse(parent.test) == "TYPE_CHECKING":
            return True
    return False


def _inside(node: ast.AST, root: ast.AST | None) -> bool:
    return root is not None and any(n is node for n in ast.walk(root))


def _mutants_of(node: ast.AST, where: str) -> Iterator[Mutant]:
    """The mutations of one node, each as the new source of the node's span (parenthesised,
    so that it means the same wherever it sits)."""
    def new(replacement: ast.AST | str, what: str) -> Mutant:
        text = replacement if isinstance(replacement, str) else f"({ast.unparse(replacement)})"
        return Mutant(*_span(node), text, what, where)

    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        swap = COMPARE_SWAPS.get(type(node.ops[0]))
        if swap is not None:
            mutated = ast.Compare(node.left, [swap()], node.comparators)
            yield new(mutated, f"{ast.unparse(node)}  ->  {ast.unparse(mutated)}")
    elif isinstance(node, ast.BinOp):
        swap = BINOP_SWAPS.get(type(node.op))
        if swap is not None:
            mutated = ast.BinOp(node.left, swap(), node.right)
            yield new(mutated, f"{ast.unparse(node)}  ->  {ast.unparse(mutated)}")
        if isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
            # x + 1 -> x, n * k -> n: an off-by-one, a forgotten factor.
            for kept, dropped in ((node.left, node.right), (node.right, node.left)):
                if isinstance(node.op, ast.Sub) and kept is node.right:
                    continue
                yield new(kept, f"{ast.unparse(node)}  ->  {ast.unparse(kept)} "
                                f"(dropped {ast.unparse(dropped)})")
    elif isinstance(node, ast.BoolOp):
        mutated = ast.BoolOp(ast.Or() if isinstance(node.op, ast.And) else ast.And(),
                             node.values)
        yield new(mutated, f"{ast.unparse(node)}  ->  {ast.unparse(mutated)}")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield new(node.operand, f"{ast.unparse(node)}  ->  {ast.unparse(node.operand)}")
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        yield new(str(not node.value), f"{node.value}  ->  {not node.value}")
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        yield new(str(node.value + 1), f"{node.value}  ->  {node.value + 1}")
    elif isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else \
            func.attr if isinstance(func, ast.Attribute) else None
        if name == "reversed" and len(node.args) == 1:
            yield new(node.args[0], f"{ast.unparse(node)}  ->  {ast.unparse(node.args[0])}")
        elif name in CALL_SWAPS:
            other = CALL_SWAPS[name]
            if isinstance(func, ast.Name):
                mutated_func: ast.expr = ast.Name(other)
            else:
                mutated_func = ast.Attribute(func.value, other)
            mutated = ast.Call(mutated_func, node.args, node.keywords)
            yield new(mutated, f"{ast.unparse(node)}  ->  {ast.unparse(mutated)}")


def _deletion(stmt: ast.stmt, where: str) -> Mutant | None:
    """A statement that changes state, replaced by ``pass``: a forgotten update."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
            or isinstance(stmt, ast.AugAssign) \
            or isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Attribute | ast.Subscript)
                                                    for t in stmt.targets):
        return Mutant(*_span(stmt), "pass", f"deleted: {ast.unparse(stmt).splitlines()[0]}",
                      where)
    return None


def find_mutants(source: str) -> list[Mutant]:
    tree = ast.parse(source)
    found: list[Mutant] = []

    def visit(node: ast.AST, parents: list[ast.AST], where: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            where = f"{where}.{node.name}" if where else node.name
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            # Decorators, bases, defaults and annotations stay as they are.
            for child in body:
                visit(child, [*parents, node], where)
            return
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return  # a docstring or a bare string
        if not _skipped(node, parents):
            if isinstance(node, ast.stmt) and where and (deleted := _deletion(node, where)):
                found.append(deleted)
            if isinstance(node, ast.expr):
                found.extend(_mutants_of(node, where))
        for child in ast.iter_child_nodes(node):
            visit(child, [*parents, node], where)

    visit(tree, [], "")
    valid = []
    for mutant in found:
        try:
            compile(mutant.apply(source), "<mutant>", "exec")
        except SyntaxError:
            continue
        valid.append(mutant)
    return sorted(set(valid), key=lambda m: (m.line, m.col, m.what))


# Imported once by the parent, so that each forked test run starts with them loaded: the
# start-up they cost is most of a short selection's time. miniinfer itself is not among them,
# since every run must import its own (mutated) copy.
PRELOADED = ("torch", "transformers", "transformers.models.llama.modeling_llama", "numpy",
             "pandas", "hypothesis", "pytest", "httpx", "fastapi", "uvicorn", "openai")


def preload() -> None:
    import importlib

    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def run_tests(root: Path, tests: list[str], timeout: float,
              trace: Path | None = None) -> tuple[str, float]:
    """'passed', 'failed' or 'timeout', and the seconds it took. The tests run in a forked
    child of this process, in ``root``, with output discarded. With ``trace``, the lines of
    that file the run executes (in this process's threads) are written to ``LINES_FILE``."""
    start = time.perf_counter()
    done = 0
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 3
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's clean-up
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.chdir(root)
            sys.path.insert(0, str(root))
            lines: set[int] = set()
            if trace is not None:
                _trace_lines(str(trace), lines)
            import pytest

            code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests]))
            if trace is not None:
                sys.settrace(None)
                (root / LINES_FILE).write_text(" ".join(map(str, sorted(lines))))
        finally:
            os._exit(code)
    deadline = start + timeout
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                return ("passed" if code == 0 else "failed"), time.perf_counter() - start
            if time.perf_counter() > deadline:
                return "timeout", time.perf_counter() - start
            time.sleep(0.05)
    finally:  # a timeout, Ctrl-C or SIGTERM: the child goes too
        if not done:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


LINES_FILE = ".mutate-lines"


def _trace_lines(filename: str, lines: set[int]) -> None:
    """Record in ``lines`` every line of ``filename`` that runs from now on, in any thread."""
    def local(frame, event, arg):
        lines.add(frame.f_lineno)
        return local

    def calls(frame, event, arg):
        if frame.f_code.co_filename == filename:
            lines.add(frame.f_lineno)
            return local
        return None

    sys.settrace(calls)
    threading.settrace(calls)


def copy_repo(target: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=ignore)
        elif source.exists():
            shutil.copy2(source, target / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("module", help="the file to mutate, e.g. miniinfer/core/scheduler.py")
    parser.add_argument("--tests", default="tests",
                        help="pytest arguments that select the tests (quoted), default: tests")
    parser.add_argument("--within", help="only mutants in functions whose qualified name "
                                         "contains this (or one of these, comma-separated), "
                                         "e.g. Scheduler.schedule")
    parser.add_argument("--only", help="only these mutants, by the numbers --list gives: 3,7,12")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--change", nargs=2, metavar=("OLD", "NEW"),
                        help="run this one hand-written mutant instead")
    parser.add_argument("--all", action="store_true",
                        help="run every mutant, also those on lines the selection never runs "
                             "(they survive by construction, unless the code runs in a child "
                             "process, which the line tracing cannot see)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds for one test run; longer counts as caught (a hang)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups

    module = Path(args.module).resolve()
    try:
        relative = module.relative_to(REPO_ROOT)
    except ValueError:
        parser.error(f"{args.module} is not inside {REPO_ROOT}")
    source = module.read_text()
    if args.change:
        old, new = args.change
        if source.count(old) != 1:
            parser.error(f"--change: the text must occur exactly once in {relative}, it occurs "
                         f"{source.count(old)} times")
        start = source[: source.index(old)]
        line = start.count("\n") + 1
        mutants = [Mutant(line, 0, line, 0, "", f"{old!r}  ->  {new!r}", "--change")]
        numbered = [(0, mutants[0])]
        patched = {mutants[0]: source.replace(old, new)}
    else:
        numbered = [(i, m) for i, m in enumerate(find_mutants(source))
                    if not args.within or any(w in m.where for w in args.within.split(","))]
        if args.list:
            for i, m in numbered:
                print(f"{i:3d}  {relative}:{m.line}  {m.where}: {m.what}")
            return 0
        if args.only:
            wanted = {int(i) for i in args.only.split(",")}
            numbered = [(i, m) for i, m in numbered if i in wanted]
        mutants = [m for _, m in numbered]
        patched = {m: m.apply(source) for m in mutants}

    tests = shlex.split(args.tests)
    with tempfile.TemporaryDirectory(prefix="miniinfer-mutate-") as tmp:
        root = Path(tmp)
        copy_repo(root)
        target = root / relative
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # A mutant of the same size written within the same second would otherwise be run
        # from the bytecode cached for the one before it.
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        sys.dont_write_bytecode = True
        preload()
        outcome, took = run_tests(root, tests, args.timeout, trace=target)
        if outcome != "passed":
            print(f"the selection does not pass on the unchanged code ({outcome}): "
                  f"{args.tests}", file=sys.stderr)
            return 2
        executed = {int(n) for n in (root / LINES_FILE).read_text().split()}
        print(f"{len(mutants)} mutant(s) of {relative}; the selection takes {took:.0f} s and "
              f"runs {len(executed)} of its lines", flush=True)
        survivors, not_run = [], []
        for n, (i, mutant) in enumerate(numbered, 1):
            label = f"#{i} {relative}:{mutant.line} {mutant.where}: {mutant.what}"
            if not args.all and not args.change and not executed.intersection(
                    range(mutant.line, mutant.end_line + 1)):
                print(f"[{n}/{len(mutants)}] NOT RUN  {label}", flush=True)
                not_run.append(mutant)
                continue
            target.write_text(patched[mutant])
            try:
                outcome, took = run_tests(root, tests, args.timeout)
            finally:
                target.write_text(source)
            caught = outcome != "passed"
            print(f"[{n}/{len(mutants)}] {'caught  ' if caught else 'SURVIVED'} {label} "
                  f"({took:.0f} s{', timeout' if outcome == 'timeout' else ''})", flush=True)
            if not caught:
                survivors.append(mutant)
    caught = len(mutants) - len(survivors) - len(not_run)
    print(f"\n{caught} of {len(mutants)} caught, {len(survivors)} survived, {len(not_run)} on "
          f"lines the selection never runs")
    for mutant in survivors:
        print(f"  survived  {relative}:{mutant.line}  {mutant.where}: {mutant.what}")
    for mutant in not_run:
        print(f"  not run   {relative}:{mutant.line}  {mutant.where}: {mutant.what}")
    return 1 if survivors or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
