"""JSONL input files (the CLI's prompt lists, the serving benchmark's datasets), read with errors
that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .errors import InvalidRequestError


def read_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """``(line number, parsed value)`` for every non-blank line of ``path``."""
    path = Path(path)
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{n} is not valid JSON ({exc.msg})") from None
