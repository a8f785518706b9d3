"""Errors a user can cause. They subclass ValueError and carry a message that names the problem;
the CLI prints them on one line and exits with status 2."""


class MiniInferError(ValueError):
    """Bad input: the message says what was wrong and what is allowed."""


class UnknownNameError(MiniInferError):
    """An unknown model, engine, device or dtype name."""


class InvalidRequestError(MiniInferError):
    """A prompt or sampling setting the engine cannot serve."""


class KVCacheFull(MiniInferError):
    """No free KV block is left for a request (chapter 08's scheduler preempts instead)."""
