"""The one place files and text come in and results go out: input files read as UTF-8 (a BOM
tolerated) with errors that name the file and line, text checked before the tokenizer sees it,
and output paths checked before any work starts (a benchmark that runs for minutes must not
fail at the end on its ``--out``), then written whole or not at all."""

from __future__ import annotations

import errno
import json
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from ..core.errors import InvalidRequestError

# Prompt and dataset files are read whole. Real ones are kilobytes to a few hundred MB; a
# bigger one is a mistake (a disk image, a log that keeps growing) that would exhaust memory.
MAX_INPUT_BYTES = 1 << 30


def check_input_file(path: str | Path, what: str) -> Path:
    """``path`` as a ``Path`` if it names a readable regular file, else an error naming it."""
    path = Path(path)
    if not path.exists():
        raise InvalidRequestError(f"{what} {path} does not exist")
    if path.is_dir():
        raise InvalidRequestError(f"{what} {path} is a directory, not a file")
    if not path.is_file():
        # A FIFO blocks until someone writes to it, /dev/zero never ends: neither is a file.
        raise InvalidRequestError(f"{what} {path} is not a regular file (a pipe, socket or "
                                  f"device); give a file")
    if not os.access(path, os.R_OK):
        raise InvalidRequestError(f"{what} {path} is not readable (permission denied)")
    return path


def read_text(path: str | Path, what: str) -> str:
    """The file's text, decoded as UTF-8 whatever the locale says; a leading BOM is dropped."""
    path = check_input_file(path, what)
    try:
        with path.open("rb") as f:
            too_big = os.fstat(f.fileno()).st_size > MAX_INPUT_BYTES
            # One byte more than allowed: a file that grows while it is read is seen too.
            data = b"" if too_big else f.read(MAX_INPUT_BYTES + 1)
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {what} {path}: {exc.strerror}") from None
    if too_big or len(data) > MAX_INPUT_BYTES:
        raise InvalidRequestError(f"{what} {path} is larger than {MAX_INPUT_BYTES >> 20} MiB, "
                                  f"the most an input file may hold")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InvalidRequestError(
            f"{what} {path}:{line} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start})") from None


def check_text(text: str, where: str) -> str:
    """``text`` unchanged if it is valid Unicode, which the tokenizer needs. A lone surrogate
    is not: JSON can spell one (``"\\ud800"``), and Python hands over command-line bytes that
    are not UTF-8 as surrogate escapes (U+DC80-U+DCFF)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        hint = (" (bytes on the command line that are not UTF-8 arrive this way)"
                if 0xDC80 <= code <= 0xDCFF else "")
        raise InvalidRequestError(f"{where} is not valid Unicode text: character {exc.start} "
                                  f"is a lone surrogate U+{code:04X}{hint}") from None
    return text


def read_jsonl(path: str | Path, what: str = "input file") -> Iterator[tuple[int, object]]:
    """``(line number, parsed value)`` for every non-blank line of the JSONL file ``path``;
    a file without one is an error. Strings in the values are checked with ``check_text``."""
    path = Path(path)
    any_line = False
    for n, line in enumerate(read_text(path, what).splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{n} is not valid JSON ({exc.msg})") from None
        for text in _strings(value):
            check_text(text, f"{path}:{n}")
        any_line = True
        yield n, value
    if not any_line:
        raise InvalidRequestError(f"{what} {path} is empty (no JSON lines)")


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.items():
            yield from _strings(list(item))
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def check_output_path(path: str | Path, what: str = "output file") -> Path:
    """``path`` as a ``Path`` once a file can be written there: it is no directory, and its
    nearest existing ancestor is a directory that takes a new file (tried for real, since
    permission bits say nothing under /proc, or to root). Missing directories are left for the
    writer to create."""
    if not str(path).strip():
        raise InvalidRequestError(f"{what} name is empty")
    path = Path(path)
    if path.is_dir():
        raise InvalidRequestError(f"{what} {path} is a directory; give a file name")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise InvalidRequestError(f"{what} {path} cannot be written: {parent} is a file, not a "
                                  f"directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise InvalidRequestError(f"{what} {path} is not writable (permission denied)")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        reason = "permission denied" if exc.errno in (errno.EACCES, errno.EPERM) \
            else exc.strerror
        raise InvalidRequestError(f"{what} {path} cannot be written: no file can be created "
                                  f"in {parent} ({reason})") from None
    return path


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temporary path)``, then the file renamed to ``path``: a reader, or a run
    stopped halfway, never sees half a file, and an old file stays until the new one is
    whole. Missing directories are created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    # Created like any new file (mode 0o666 less the umask; mkstemp would make it 0o600).
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
