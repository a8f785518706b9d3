"""Stage ``speculative``: several tokens per step, the same tokens out (chapter 14).

Chapter 09's engine, whose every decode step reads all the weights to produce one token per
request. While a step is memory-bound, feeding a request a few more tokens costs almost
nothing, so this stage guesses (drafts) a request's next ``k`` tokens and lets the one forward
check them all (:mod:`miniinfer.core.speculative`):

- ``schedule``: before the scheduler decides, each decoding request gets a draft from prompt
  lookup over its own text, as long as :class:`~miniinfer.core.speculative.DraftBudget` says
  it pays (variant ``fixed``: always ``num_draft_tokens`` where the lookup finds them). The
  scheduler feeds the last token and the drafts (``Request.draft_ids``) and scores all
  ``k + 1`` positions (``ScheduledBatch.num_scored``);
- ``sample``: greedy requests keep the drafts that equal the model's argmax plus one token of
  the model's; sampled ones use rejection sampling, so their tokens follow the model's
  distribution exactly;
- ``commit``: the rejected drafts' K/V is taken back (``BlockManager.truncate``) before the
  kept tokens are appended, so the cache holds exactly the committed tokens' K/V again, and
  the prefix cache never hashes a draft.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.config import EngineConfig
from ..core.errors import InvalidRequestError
from ..core.hardware import RESULTS_DIR, YOURS_DIR, device_slug
from ..core.models import LoadedModel
from ..core.sampling import sample_batch, sampling_probs
from ..core.scheduler import Request, ScheduledBatch
from ..core.speculative import (
    Acceptance,
    DraftBudget,
    NgramIndex,
    StepCosts,
    SuffixIndex,
    accept_greedy,
    accept_sampled,
)
from .prefix_cache import PrefixCacheEngine

# A step's cost model per device where none was measured (DraftBudget): the tokens a step holds
# before it turns compute-bound (the roofline's ridge), and what each fed token adds, as a share
# of a one-token step. A device's measured costs (bench.step_costs, for the engine's model,
# forward and weights) replace it; the figures behind these are in data/results/ch14/NOTES.md.
DRAFT_COSTS = {"cpu": (16.0, 0.25), "cuda": (128.0, 0.002)}


@dataclass(slots=True)
class SpeculationStats:
    """Counts since the engine started: draft tokens proposed and kept, and request-steps (one
    request in one step) with the tokens they produced."""

    drafted: int = 0
    accepted: int = 0
    request_steps: int = 0  # request-steps that produced tokens
    drafted_steps: int = 0  # of them, the ones that verified a draft
    tokens: int = 0  # tokens those request-steps produced
    # Drafted request-steps by how many of their drafts they kept (chapter 14's histogram).
    kept_drafts: Counter[int] = field(default_factory=Counter)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a request gets from one step (1.0 without speculation)."""
        return self.tokens / self.request_steps if self.request_steps else 0.0


@dataclass(slots=True)
class _Drafter:
    index: NgramIndex | SuffixIndex
    acceptance: Acceptance


DRAFTERS = {"ngram": NgramIndex, "suffix": SuffixIndex}


def step_costs_file(root: Path, device: torch.device) -> Path:
    """Where a device's measured step costs are kept: beside chapter 14's recording."""
    return root / "ch14" / f"{device_slug(device)}-step-costs.csv"


def measured_step_costs(device: torch.device, model: str, forward: str,
                        weights: str) -> StepCosts | None:
    """This device's measured step costs for the engine's model, forward and weights: the
    reader's own recording first, then the book's; None where neither has them."""
    for root in (YOURS_DIR, RESULTS_DIR):
        costs = StepCosts.read(step_costs_file(root, device), model=model, forward=forward,
                               weights=weights)
        if costs is not None:
            return costs
    return None


class SpeculativeEngine(PrefixCacheEngine):
    name = "speculative"
    summary = "n-gram (prompt lookup) drafts, k + 1 positions verified in one step, lossless"
    preset = {**PrefixCacheEngine.preset, "speculative": "ngram"}
    variants = ("adaptive", "fixed")
    variant_option = "draft_policy"

    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None, **options) -> None:
        """The draft settings (``num_draft_tokens``, ``draft_policy``, ``knee_tokens``,
        ``token_cost``) are the config's, like every other setting."""
        super().__init__(lm, config, **options)
        config = self.config
        if config.speculative is None:
            raise InvalidRequestError("the speculative stage needs a drafter (speculative="
                                      f"{' or '.join(map(repr, DRAFTERS))}); without drafts, "
                                      "use its base engine")
        self.draft_policy = config.draft_policy
        knee, cost = DRAFT_COSTS.get(self.device.type, DRAFT_COSTS["cuda"])
        # A cost model given in the config is used as given; else the device's measured one.
        modelled = config.knee_tokens is not None or config.token_cost is not None
        measured = None if modelled else measured_step_costs(
            self.device, lm.name, self.runner.forward_name, config.weights)
        self.draft_budget = DraftBudget(config.num_draft_tokens,
                                        knee if config.knee_tokens is None else config.knee_tokens,
                                        cost if config.token_cost is None else config.token_cost,
                                        measured)
        self.stats = SpeculationStats()
        self._drafters: dict[Request, _Drafter] = {}  # by the request itself: ids are reused

    def schedule(self) -> ScheduledBatch:
        """Draft for the decoding requests, then let chapter 08's scheduler decide."""
        self._propose_drafts()
        return super().schedule()

    def _propose_drafts(self) -> None:
        scheduler = self.scheduler
        for request in [r for r in self._drafters if r.finished]:
            del self._drafters[request]  # finished or aborted
        decoding = [r for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        for request in decoding:
            request.draft_ids.clear()
        candidates, drafts = [], []
        for request in decoding:
            # A step yields up to k + 1 tokens; more drafts than the request may still
            # produce would be wasted (and would need KV slots its limit never counted).
            k = min(self.draft_budget.max_draft,
                    request.params.max_new_tokens - len(request.output_ids) - 1)
            if k <= 0 or not self.can_draft(request):
                continue
            draft = self.propose(request, k)
            if draft:
                drafts.append((request, draft))
                candidates.append((len(draft), self._drafter(request).acceptance.rate))
        if not drafts:
            return
        if self.draft_policy == "fixed":
            lengths = [n for n, _ in candidates]
        else:
            # The step's other tokens: every decode, and as much prompt as the budget holds.
            budget = scheduler.config.max_num_batched_tokens
            prompts = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.running
                          if r.num_tokens - r.num_computed_tokens > 1)
            prompts += sum(r.num_tokens for r in scheduler.waiting)
            base = max(len(decoding), min(len(decoding) + prompts, budget))
            lengths = self.draft_budget.allocate(base, len(decoding), candidates)
        for (request, draft), k in zip(drafts, lengths, strict=True):
            request.draft_ids = draft[:k]

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to ``k`` draft tokens for a request, looked up in its own text."""
        return self._drafter(request).index.propose(request.token_ids(0, request.num_tokens), k)

    def _drafter(self, request: Request) -> _Drafter:
        drafter = self._drafters.get(request)
        if drafter is None:
            index = DRAFTERS[self.config.speculative]()
            drafter = self._drafters[request] = _Drafter(index, Acceptance())
        return drafter

    def can_draft(self, request: Request) -> bool:
        """Whether verification can score a request's drafts with the state it has now: the
        sampler reads a request's committed output for penalties and ``min_tokens``, which a
        draft would change mid-step; sampled logprobs would need the rejection's draw."""
        params = request.params
        return (not params.penalised and len(request.output_ids) >= params.min_tokens
                and (params.greedy or params.logprobs is None))

    def sample(self, logits: torch.Tensor, rows: list[Request]) -> list[tuple[Request, list[int]]]:
        """Verify each request's drafts against its rows (one row per scored position)."""
        spans: list[tuple[Request, int, int]] = []  # request, first row, number of rows
        for i, request in enumerate(rows):
            if spans and spans[-1][0] is request:
                spans[-1] = (request, spans[-1][1], spans[-1][2] + 1)
            else:
                spans.append((request, i, 1))
        # Greedy rows and undrafted rows in one pass of chapter 08's sampler; drafted rows
        # that sample go to rejection sampling, which needs the target's probabilities.
        rejection = [s for s in spans if s[2] > 1 and not s[0].params.greedy]
        plain = [s for s in spans if s[2] == 1 or s[0].params.greedy]
        kept: dict[Request, list[int]] = {}
        if plain:
            index = [first + j for _, first, count in plain for j in range(count)]
            sampled = sample_batch(logits[index], [rows[i] for i in index],
                                   self.lm.eos_token_id)
            row = 0
            for request, _, count in plain:
                targets = sampled.token_ids[row:row + count]
                tokens = accept_greedy(request.draft_ids, targets) if count > 1 else targets
                for logprobs in sampled.logprobs[row:row + len(tokens)]:
                    if logprobs is not None:
                        request.output_logprobs.append(logprobs)
                        request.cumulative_logprob += logprobs.logprob
                kept[request] = tokens
                row += count
        if rejection:
            index = [first + j for _, first, count in rejection for j in range(count)]
            probs = sampling_probs(logits[index], [rows[i] for i in index],
                                   self.lm.eos_token_id)
            row = 0
            for request, _, count in rejection:
                generator = request.generator if request.params.seed is not None else None
                kept[request] = accept_sampled(request.draft_ids, probs[row:row + count],
                                               generator)
                row += count
        return [(request, kept[request]) for request, _, _ in spans]

    def commit(self, request: Request, tokens: list[int], now: float) -> None:
        """Take back the rejected drafts' K/V, then append the kept tokens."""
        drafted = len(request.draft_ids)
        accepted = len(tokens) - 1
        if drafted:
            # The step computed K/V for the last token and every draft; keep the last token's
            # and the accepted drafts'. The new last token (the model's own) is fed next step.
            rejected = drafted - accepted
            request.num_computed_tokens -= rejected
            self.kv_cache.block_manager.truncate(request.request_id, rejected)
            request.draft_ids.clear()
            self._drafter(request).acceptance.update(drafted, accepted)
        stats = self.stats
        stats.drafted += drafted
        stats.accepted += accepted
        stats.request_steps += 1
        stats.drafted_steps += drafted > 0
        if drafted:
            stats.kept_drafts[accepted] += 1
        before = len(request.output_ids)
        super().commit(request, tokens, now)
        appended = len(request.output_ids) - before
        stats.tokens += appended
        # A stop among the kept tokens drops the ones after it, and their logprobs.
        if request.params.logprobs is not None and appended < len(tokens):
            dropped = request.output_logprobs[before + appended:]
            del request.output_logprobs[before + appended:]
            request.cumulative_logprob -= sum(lp.logprob for lp in dropped)
