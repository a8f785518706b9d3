"""What every engine stage shares: the interface, input validation, padding and step timing."""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import ClassVar

import torch

from ..core.errors import InvalidRequestError
from ..core.models import LoadedModel
from ..core.sampling import SamplingParams


@dataclass(slots=True)
class GenerationResult:
    """Generated ids per prompt (EOS included when a request stopped on it) and step times.

    ``token_times`` holds one ``perf_counter`` stamp per output position ``k``: when every
    prompt's ``k``-th token was on the host. The first is the batch's time to first token, the
    gaps its decode steps. A static batch stamps each step; an engine whose requests advance at
    different steps builds them with :func:`batch_token_times`.
    """

    token_ids: list[list[int]]
    start: float
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.start

    @property
    def decode_step_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def batch_token_times(per_request: Iterable[Sequence[float]]) -> list[float]:
    """A batch's ``token_times`` from each request's own stamps: for each position ``k``, the
    latest request's ``k``-th token (one that stopped early no longer counts). With continuous
    batching a long batch of prompts takes several steps to prefill, and the first step's end
    is only the first request's first token: stamping steps would make the "time to first
    token" and the decode steps of a continuous engine mean something else than a static
    batch's, or a peer's."""
    return [max(t for t in ts if t is not None) for ts in zip_longest(*per_request)]


class Engine:
    """One stage of the book's engine. Subclasses implement ``_generate``.

    ``generate`` takes pre-tokenized prompts (a batch of token-id lists of any lengths) and
    returns only the newly generated ids; all stages share this so the benchmark and the
    correctness tests treat them alike.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    # Whether the stage samples with sampling.sample_batch, which applies SamplingParams.extras.
    sampling_extras: ClassVar[bool] = False
    # Named variants ("stage:variant"), each one value of this option.
    variants: ClassVar[tuple[str, ...]] = ()
    variant_option: ClassVar[str] = ""

    @classmethod
    def variant_options(cls, variant: str) -> dict[str, object]:
        """The options the variant ``variant`` stands for."""
        return {cls.variant_option: variant}

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.model = lm.model
        self.device = lm.device

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> GenerationResult:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got "
                                      f"{type(params).__name__}")
        prompts = token_id_lists(prompts)
        self.validate(prompts, params)
        with torch.inference_mode():
            return self._generate(prompts, params)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        raise NotImplementedError

    def pad_finished(self, tokens: torch.Tensor, finished: torch.Tensor,
                     params: SamplingParams) -> tuple[torch.Tensor, bool]:
        """The batch moves in lockstep: a row that has emitted EOS keeps decoding but emits
        padding, as ``generate`` does. Updates ``finished`` [B] in place; returns the tokens to
        emit and whether every row is done."""
        if params.ignore_eos:
            return tokens, False
        tokens = self.mask_finished(tokens, finished, params)
        # .all() copies a flag to the host: the one sync per step a stop check needs.
        return tokens, bool(finished.all())

    def mask_finished(self, tokens: torch.Tensor, finished: torch.Tensor,
                      params: SamplingParams) -> torch.Tensor:
        """``pad_finished`` without its host read: the padding decided on the device, for a
        loop that must not wait on it (chapter 07)."""
        if params.ignore_eos:
            return tokens
        tokens = tokens.masked_fill(finished, self.lm.pad_token_id)
        finished |= tokens == self.lm.eos_token_id
        return tokens

    def validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if not prompts:
            raise InvalidRequestError("no prompts given")
        if params.extras and not self.sampling_extras:
            raise InvalidRequestError(
                f"{', '.join(params.extras)}: the {self.name} engine does not apply these; "
                f"the continuous engines (continuous, prefix-cache) do")
        vocab = self.lm.config.vocab_size
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise InvalidRequestError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise InvalidRequestError(f"prompt {i} has token ids outside [0, {vocab})")
            need = len(prompt) + params.max_new_tokens
            if need > self.lm.max_context:
                raise InvalidRequestError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens="
                    f"{params.max_new_tokens} it needs {need} positions, more than the model's "
                    f"context of {self.lm.max_context}"
                )


def token_id_lists(prompts: object) -> list[list[int]]:
    """``prompts`` as lists of Python ints: a sequence of prompts, each a sequence of integer
    token ids. Integers of any kind are taken (numpy's, 0-d integer tensors); a string, a
    float or a bool is refused (``True`` is an int to Python, but never a token the caller
    meant)."""
    def sequence(value: object, what: str) -> list:
        if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
            raise InvalidRequestError(f"{what}, got {type(value).__name__}")
        return list(value)

    out = []
    for i, prompt in enumerate(sequence(
            prompts, "prompts must be a list of prompts, each a list of integer token ids")):
        ids = []
        for j, token in enumerate(sequence(
                prompt, f"prompt {i} must be a list of integer token ids")):
            try:
                if isinstance(token, bool):
                    raise TypeError
                ids.append(operator.index(token))
            except TypeError:
                raise InvalidRequestError(f"prompt {i}: token {j} is {token!r} "
                                          f"({type(token).__name__}), not an integer token "
                                          f"id") from None
        out.append(ids)
    return out


class StepClock:
    """Stamps the time of each generated token. On CUDA it synchronises first, so a stamp
    means the device work is done, not merely queued."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self.result_times: list[float] = []
        self.start = self.now()

    def now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def tick(self) -> None:
        self.result_times.append(self.now())

    def stamp(self) -> None:
        """Like ``tick`` without the synchronisation, for a caller that has just waited for
        this step's tokens itself (and must not wait for the steps queued after it)."""
        self.result_times.append(time.perf_counter())

    def finish(self, token_ids: list[list[int]]) -> GenerationResult:
        return GenerationResult(token_ids, self.start, self.result_times, self.now())


def left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch prompts of different lengths: pad on the left so every row's last token is at the
    same index, which is where decode appends. Returns input ids and the 0/1 attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def trim_at_eos(rows: list[list[int]], eos_id: int | None) -> list[list[int]]:
    """Cut each row after its first EOS (kept), dropping the padding a batch adds after it."""
    if eos_id is None:
        return rows
    return [row[: row.index(eos_id) + 1] if eos_id in row else row for row in rows]
