"""Speculative decoding's pieces (chapter 14): a drafter that guesses a request's next tokens
from its own text, the rules that verify a guess against the model, and how many tokens to
guess per request in a given step.

- **Draft** (prompt lookup): the last ``n`` tokens (n = 3, 2, 1) of the request's prompt and
  output, found earlier in that text, propose the tokens that followed them there. Free to
  compute, and right often when the output copies its input (summaries, extraction, edits).
  :class:`SuffixIndex` is its second form (after SuffixDecoding, Oliaro et al. 2024): the
  longest earlier match of the text's suffix, however long, and a draft as long as that match
  makes it likely to hold (a one-token match drafts one token, a long copy drafts ``k``).
- **Verify**: the step feeds the request's last token and its ``k`` drafts and scores all
  ``k + 1`` positions in one forward. Greedy: drafts are kept while they equal the model's
  argmax, and the first one that does not is replaced by the model's token, so a step yields
  between 1 and ``k + 1`` tokens, exactly the ones plain decoding would. Sampling: a draft
  ``x`` from a draft distribution ``q`` is kept with probability ``min(1, p(x) / q(x))``, and on
  a rejection a token is drawn from ``norm(max(0, p - q))``; the output then follows the
  target ``p`` exactly (Leviathan et al. 2023; Chen et al. 2023). A lookup draft is a point
  mass (``q(x) = 1``): keep ``x`` with probability ``p(x)``, else draw from ``p`` without ``x``.
- **How many**: verifying costs almost nothing while a step is memory-bound (the weights are
  read once whether the step holds 1 token or 8) and costs in proportion once it is
  compute-bound. :class:`DraftBudget` gives each request the draft tokens that raise the
  expected tokens per unit of step time, from its own acceptance so far and the step's cost:
  measured on the device where a recording exists (:class:`StepCosts`), else the roofline's.
"""

from __future__ import annotations

import csv
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import InvalidRequestError


@dataclass(slots=True)
class NgramIndex:
    """Prompt lookup over one request's growing text. ``followers[n-gram]`` is where the tokens
    after that n-gram's latest occurrence start; the index grows with the text (three dict
    writes a token), so a lookup costs the same at any length."""

    max_ngram: int = 3
    followers: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """``k`` tokens that followed the longest suffix of ``tokens`` (3, 2, then 1 tokens)
        the last time it occurred; [] where none occurred before. A copy that reaches the end
        of the text goes on from what it copied (the text read as repeating itself), so a
        loop of one token still drafts ``k``."""
        length = len(tokens)
        # Index every n-gram ending before the last token: the suffix itself is not a match.
        for end in range(max(self.num_indexed, 1), length):
            for n in range(1, min(self.max_ngram, end) + 1):
                self.followers[tuple(tokens[end - n:end])] = end
        self.num_indexed = max(self.num_indexed, length)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, length), 0, -1):
            start = self.followers.get(tuple(tokens[length - n:]))
            if start is not None:
                draft: list[int] = []
                for pos in range(start, start + k):
                    draft.append(tokens[pos] if pos < length else draft[pos - length])
                return draft
        return []


@dataclass(slots=True)
class SuffixIndex:
    """Suffix lookup over one request's growing text: of the earlier places where the text's
    last token occurred, the one whose preceding tokens match the text's end the longest (the
    latest on a tie) proposes the tokens that followed it. The draft is ``alpha`` times the
    match's length, at most ``k``: a long match is a copy in progress, a short one a guess.
    ``positions[token]`` lists where each token occurred, so a lookup reads the last
    ``max_candidates`` of them, each compared back at most ``max_match`` tokens."""

    alpha: float = 1.0
    max_match: int = 32
    max_candidates: int = 64
    positions: dict[int, list[int]] = field(default_factory=dict)
    num_indexed: int = 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        length = len(tokens)
        for pos in range(self.num_indexed, length - 1):  # the last token is the query
            self.positions.setdefault(tokens[pos], []).append(pos)
        self.num_indexed = max(self.num_indexed, length - 1)
        if k <= 0 or length < 2:
            return []
        best, best_match = -1, 0
        for pos in reversed(self.positions.get(tokens[-1], [])[-self.max_candidates:]):
            match = 1
            while (match < self.max_match and pos - match >= 0
                   and tokens[pos - match] == tokens[length - 1 - match]):
                match += 1
            if match > best_match:
                best, best_match = pos, match
        if best < 0:
            return []
        n = min(k, max(1, math.floor(self.alpha * best_match)))
        draft: list[int] = []
        for pos in range(best + 1, best + 1 + n):
            draft.append(tokens[pos] if pos < length else draft[pos - length])
        return draft


def accept_greedy(draft: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens a greedy step keeps: ``target`` holds the model's argmax at each of the
    ``k + 1`` scored positions; drafts are kept while they equal it, then the model's own token
    follows (a correction, or the bonus token after ``k`` accepted drafts)."""
    if len(target) != len(draft) + 1:
        raise InvalidRequestError(f"{len(draft)} drafts need {len(draft) + 1} target tokens, "
                                  f"got {len(target)}")
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target[accepted]:
        accepted += 1
    return [*draft[:accepted], target[accepted]]


def accept_sampled(draft: Sequence[int], probs: torch.Tensor,
                   generator: torch.Generator | None) -> list[int]:
    """The tokens a sampled step keeps, by rejection sampling against a point-mass draft:
    ``probs`` [k + 1, V] are the target's distributions at the scored positions (after
    temperature, top-k, top-p: what plain sampling would draw from). Draft ``x_j`` is kept
    with probability ``p_j(x_j)``; the first rejected one is replaced by a draw from ``p_j``
    with ``x_j`` taken out, and after ``k`` kept drafts one more token is drawn from
    ``p_k``."""
    k = len(draft)
    if probs.shape[0] != k + 1:
        raise InvalidRequestError(f"{k} drafts need {k + 1} rows of probabilities, got "
                                  f"{probs.shape[0]}")
    device = probs.device
    if k:
        p_draft = probs[:k].gather(1, torch.tensor(draft, device=device)[:, None])[:, 0]
        u = torch.rand(k, generator=generator, device=device, dtype=probs.dtype)
        kept = (u < p_draft).tolist()
    else:
        kept = []
    accepted = next((j for j, ok in enumerate(kept) if not ok), k)
    last = probs[accepted]
    if accepted < k:  # norm(max(0, p - q)) with q a point mass on the rejected draft
        residual = last.clone()
        residual[draft[accepted]] = 0
        if residual.sum() > 0:  # p(x) == 1 is always kept; rounding aside
            last = residual
    token = torch.multinomial(last, 1, generator=generator).item()
    return [*draft[:accepted], token]


@dataclass(slots=True)
class Acceptance:
    """One request's acceptance rate, an estimate that forgets: each drafted position is a
    trial, kept drafts successes, and the first rejection ends a step's trials (the ones
    after it were never tested). Starts at 1/2 (one success in two pseudo-trials)."""

    successes: float = 0.0
    trials: float = 0.0
    decay: float = 0.8  # per step: about the last five steps count

    @property
    def rate(self) -> float:
        return (self.successes + 1) / (self.trials + 2)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.successes = self.decay * self.successes + accepted
            self.trials = self.decay * self.trials + accepted + (accepted < drafted)


@dataclass(frozen=True, slots=True)
class StepCosts:
    """A step's time with 1, 2, ... tokens fed, relative to a one-token step's, as measured
    on one device for one forward, weights and model (:mod:`miniinfer.bench.step_costs`
    records them). Past the last count measured, each token adds the measured mean."""

    relative: tuple[float, ...]  # [n - 1]: the step with n tokens over the step with 1

    def __post_init__(self) -> None:
        if not self.relative or any(not c > 0 for c in self.relative):
            raise ValueError(f"step costs must be positive, got {self.relative!r}")

    def __call__(self, num_tokens: int) -> float:
        costs, n = self.relative, max(num_tokens, 1)
        if n <= len(costs):
            return costs[n - 1]
        per_token = (costs[-1] - costs[0]) / (len(costs) - 1) if len(costs) > 1 else 1.0
        return costs[-1] + max(per_token, 0.0) * (n - len(costs))

    @staticmethod
    def read(path: Path, **key: str) -> StepCosts | None:
        """The costs recorded in ``path`` (a CSV with ``tokens`` and ``relative_cost``
        columns) for the rows whose columns equal ``key`` (model, forward, weights); None
        where there is no file or no unbroken run of counts from 1."""
        if not path.is_file():
            return None
        with path.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if all(r.get(c) == v for c, v in key.items())]
        by_count = {int(r["tokens"]): float(r["relative_cost"]) for r in rows}
        costs = []
        while len(costs) + 1 in by_count:
            costs.append(by_count[len(costs) + 1])
        # A step with more tokens does not cost less: a dip is the measurement's noise.
        return StepCosts(tuple(itertools.accumulate(costs, max))) if len(costs) > 1 else None


@dataclass(frozen=True, slots=True)
class DraftBudget:
    """How many draft tokens each request gets in one step. A step's time is modelled on the
    roofline: flat up to ``knee_tokens`` tokens (reading the weights dominates, and extra
    tokens ride along), then proportional to its tokens (compute-bound), plus ``token_cost``
    of a flat step for every token fed (attention, the LM head row, sampling). A request that
    accepts each draft with probability ``a`` gains ``a ** (j + 1)`` expected tokens from its
    ``j + 1``-th draft; draft tokens go, best gain first, while the expected tokens per unit
    of step time still rise. So a lone request drafts freely, a full batch drafts nothing,
    and a request whose drafts keep failing soon stops drafting."""

    # No defaults: the engine's config holds them (num_draft_tokens), and the device's cost
    # model (engines.speculative.DRAFT_COSTS) the other two.
    max_draft: int
    knee_tokens: float
    token_cost: float
    measured: StepCosts | None = None  # where given, the step's cost instead of the model's

    def step_cost(self, num_tokens: int) -> float:
        if self.measured is not None:
            return self.measured(num_tokens)
        return max(1.0, num_tokens / self.knee_tokens) + self.token_cost * num_tokens

    def allocate(self, base_tokens: int, base_yield: float,
                 candidates: Sequence[tuple[int, float]]) -> list[int]:
        """Draft lengths for ``candidates`` ``(tokens the drafter found, acceptance rate)``,
        in a step that already feeds ``base_tokens`` tokens and yields ``base_yield`` tokens
        (its decodes)."""
        lengths = [0] * len(candidates)
        heap = [(-rate, i) for i, (found, rate) in enumerate(candidates)
                if found > 0 and rate > 0]
        heapq.heapify(heap)
        tokens, expected = base_tokens, base_yield
        while heap:
            gain, i = heapq.heappop(heap)
            gain = -gain
            if (expected + gain) * self.step_cost(tokens) \
                    <= expected * self.step_cost(tokens + 1):
                break  # the best remaining draft no longer pays for the time it adds
            lengths[i] += 1
            tokens += 1
            expected += gain
            found, rate = candidates[i]
            if lengths[i] < min(found, self.max_draft):
                heapq.heappush(heap, (-gain * rate, i))
        return lengths
