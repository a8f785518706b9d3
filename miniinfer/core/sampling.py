"""Sampling parameters (validated) and the sampler every engine shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidRequestError

# Below this, logits / temperature overflows float32 for large logits (1e-300 is 0 in
# float32: every logit becomes inf and softmax NaN), and long before it sampling is argmax in
# all but name: at 0.01 a logit gap of 0.1 already weighs e^10. vLLM raises smaller values to
# 0.01 with a warning; we refuse them, so that what runs is what was asked for.
MIN_TEMPERATURE = 1e-2
# The seeds torch.Generator.manual_seed accepts (a 64-bit integer, signed or not).
SEED_RANGE = (-(2**63), 2**64 - 1)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` means greedy (argmax); otherwise it
    must be at least ``MIN_TEMPERATURE``. Every value is checked here, so an engine never
    meets one it cannot use."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks generate a fixed number of tokens

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1 (an integer), got "
                                      f"{self.max_new_tokens!r}")
        # `not x >= ...` also rejects NaN; inf would make every probability equal (or NaN).
        if not _is_real(self.temperature) or not self.temperature >= 0 \
                or self.temperature == float("inf"):
            raise InvalidRequestError(f"temperature must be >= 0 (a finite number), got "
                                      f"{self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got "
                f"{self.temperature!r}: below that logits / temperature can overflow, and "
                f"sampling is greedy anyway")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        low, high = SEED_RANGE
        if self.seed is not None and (not _is_int(self.seed) or not low <= self.seed <= high):
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**64 - 1] "
                                      f"(torch's range), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be True or False, got "
                                      f"{self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf. ``logits``: [B, V]."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already hold top_p of the mass; the most
        # likely token is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V].

    Sampling is an exponential race: each token draws ``E ~ Exp(1)`` and the smallest
    ``E / p`` wins, which picks token ``i`` with probability ``p_i`` (the Gumbel-max trick in
    another form). It is what ``torch.multinomial`` computes for one sample, from the same
    generator (so a seed draws the tokens it drew with it), minus multinomial's check of its
    input on the host: device ops only, so a decode step that samples never waits for the
    device."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    # A draw of exactly 0 would divide to inf or NaN; the clamp keeps it finite (and a
    # filtered token's probability 0 stays 0).
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
