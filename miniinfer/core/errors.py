"""Errors a user can cause. They subclass ValueError and carry a message that names the problem;
the CLI prints them on one line and exits with status 2. ``Interrupted`` is Ctrl-C with the
work that had finished."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager


class MiniInferError(ValueError):
    """Bad input: the message says what was wrong and what is allowed."""


class UnknownNameError(MiniInferError):
    """An unknown model, engine, device or dtype name."""


class InvalidRequestError(MiniInferError):
    """A prompt or sampling setting the engine cannot serve."""


class KVCacheFull(MiniInferError):
    """No free KV block is left for a request (chapter 08's scheduler preempts instead)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a benchmark. Still a KeyboardInterrupt (a notebook stops as usual), it
    carries what had finished before it (``partial``; None when nothing had), so that the CLI
    can keep it."""

    def __init__(self, partial: object | None) -> None:
        super().__init__()
        self.partial = partial


@contextmanager
def keep_on_interrupt(finished: Callable[[], object | None]) -> Iterator[None]:
    """Ctrl-C inside the block becomes ``Interrupted(finished())``."""
    try:
        yield
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise Interrupted(finished()) from None


def one_line(error: BaseException) -> str:
    """``error`` as its type and the first line of its message: why a fast path was not
    taken, in a warning or a recorded column."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}".rstrip(": ")
