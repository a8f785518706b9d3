"""Sampling parameters (validated), the single-batch sampler of the static stages, and the
batched sampler of the continuous engines (one pass per step over rows that each carry their
own parameters: vLLM's sampling extras)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .errors import InvalidRequestError

# Below this, logits / temperature overflows float32 for large logits (1e-300 is 0 in
# float32: every logit becomes inf and softmax NaN), and long before it sampling is argmax in
# all but name: at 0.01 a logit gap of 0.1 already weighs e^10. vLLM raises smaller values to
# 0.01 with a warning; we refuse them, so that what runs is what was asked for.
MIN_TEMPERATURE = 1e-2
# The seeds torch.Generator.manual_seed accepts (a 64-bit integer, signed or not).
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value


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
    # vLLM's extras; only the continuous engines' batched sampler (sample_batch) applies them.
    min_p: float = 0.0  # drop tokens below min_p * the most likely token's probability
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output
    presence_penalty: float = 0.0  # subtracted once from each token the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request, like EOS
    min_tokens: int = 0  # EOS and stop_token_ids are not sampled before this many tokens
    # None: no logprobs; k >= 0: the sampled token's logprob and the k most likely tokens'
    logprobs: int | None = None

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
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got "
                                      f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.logit_bias, tuple) or not all(
                isinstance(item, tuple) and len(item) == 2 and _is_int(item[0]) and item[0] >= 0
                and _is_real(item[1]) and -MAX_LOGIT_BIAS <= item[1] <= MAX_LOGIT_BIAS
                for item in self.logit_bias):
            raise InvalidRequestError(f"logit_bias must be a tuple of (token id >= 0, bias in "
                                      f"[-100, 100]) pairs, got {self.logit_bias!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be a tuple of token ids >= 0, got "
                                      f"{self.stop_token_ids!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_new_tokens="
                                      f"{self.max_new_tokens}], got {self.min_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be None or an integer in [0, "
                                      f"{MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def extras(self) -> list[str]:
        """The vLLM extras this request uses (only ``sample_batch`` applies them)."""
        return [name for name, default in _EXTRA_DEFAULTS if getattr(self, name) != default]

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in ``logit_bias`` and ``stop_token_ids`` must exist in the vocabulary."""
        ids = [t for t, _ in self.logit_bias] + list(self.stop_token_ids)
        if ids and max(ids) >= vocab_size:
            raise InvalidRequestError(f"logit_bias and stop_token_ids must name token ids in "
                                      f"[0, {vocab_size}), got {max(ids)}")


# Each extra with the value that leaves sampling as it was.
_EXTRA_DEFAULTS = (("min_p", 0.0), ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                   ("frequency_penalty", 0.0), ("logit_bias", ()), ("stop_token_ids", ()),
                   ("min_tokens", 0), ("logprobs", None))


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
    """Set logits outside the top-k / top-p (nucleus) set to -inf. ``logits``: [B, V]. The
    batched sampler's filter (:func:`_filtered_logits`) with one setting for every row."""
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    return _filtered_logits(logits, [params] * logits.shape[0])


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V], every row with the same
    parameters and one generator (the static-batch stages): the batched sampler's filters and
    race (:func:`sample_from_probs`), its parameters broadcast over the rows."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = _row_probs(logits.float(), [params] * logits.shape[0])
    return _race(probs, torch.empty_like(probs).exponential_(generator=generator))


def _race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The token each row draws: an exponential race. Each token draws ``E ~ Exp(1)`` and the
    smallest ``E / p`` wins, which picks token ``i`` with probability ``p_i`` (the Gumbel-max
    trick in another form). It is what ``torch.multinomial`` computes for one sample, from the
    same generator (so a seed draws the tokens it drew with it), minus multinomial's check of
    its input on the host: device ops only, so a decode step that samples never waits for
    the device."""
    # A draw of exactly 0 would divide to inf or NaN; the clamp keeps it finite (and a
    # filtered token's probability 0 stays 0).
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


@dataclass(slots=True)
class TokenLogprobs:
    """A sampled token's log-probability under the model, and the ``k`` most likely tokens with
    theirs (most likely first). Taken from the raw logits, before penalties, bias, temperature
    or filters, as vLLM reports them by default: what the model thinks, not what was drawn."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class PenaltyState:
    """What the penalties need from one request's history, kept on the device: which tokens
    the prompt holds, and how often each token occurs in the output, counted up to
    ``num_counted`` output tokens (the sampler adds the newer ones before each use)."""

    prompt_mask: torch.Tensor  # bool [V]
    output_counts: torch.Tensor  # int32 [V]
    num_counted: int = 0

    @classmethod
    def new(cls, prompt_ids: Sequence[int], vocab_size: int, device: torch.device) -> PenaltyState:
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[torch.tensor(prompt_ids, device=device)] = True
        return cls(mask, torch.zeros(vocab_size, dtype=torch.int32, device=device))

    def update(self, output_ids: Sequence[int]) -> torch.Tensor:
        new = output_ids[self.num_counted:]
        if new:
            index = torch.tensor(new, device=self.output_counts.device)
            self.output_counts.index_put_((index,), torch.ones_like(index, dtype=torch.int32),
                                          accumulate=True)
            self.num_counted = len(output_ids)
        return self.output_counts


class Request(Protocol):
    """What the batched sampler reads of a request (the scheduler's ``Request`` has it)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    penalty_state: PenaltyState | None
    generator: torch.Generator | None


@dataclass(slots=True)
class SampledTokens:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row: None unless its params ask for logprobs


def sample_batch(logits: torch.Tensor, requests: Sequence[Request],
                 eos_token_id: int | None) -> SampledTokens:
    """Next tokens for a batch whose rows each carry their own parameters: ``logits`` [k, V]
    are the scored positions' logits of ``requests`` (one request per row). A request may
    name several consecutive rows (a speculative step scores k + 1 positions of one request):
    each row is sampled with the request's committed state (its output so far for penalties
    and ``min_tokens``), and a seeded request draws its rows' noise in row order.

    One pass over the batch, every step a tensor op over all rows (the rows that use a
    feature, where only some do), in vLLM's order: logit bias; EOS and stop tokens masked
    before ``min_tokens``; repetition, frequency and presence penalties; then greedy rows
    take the argmax, and sampled rows divide by their temperature and go through min-p,
    top-k and top-p before the exponential race of ``sample``. A seeded row draws its noise
    from its own generator (so a seed gives the same tokens in any batch); the others share
    one draw. The host sees one copy: the tokens and the logprobs together."""
    params = [r.params for r in requests]
    if all(p.greedy and not p.extras for p in params):
        return SampledTokens(logits.argmax(dim=-1).tolist(), [None] * len(params))
    logits = logits.float().clone()
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_logprobs = logits[logprob_rows].log_softmax(dim=-1) if logprob_rows else None
    _apply_logit_bias(logits, params)
    _mask_stops_before_min_tokens(logits, requests, eos_token_id)
    _apply_penalties(logits, requests)
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        tokens[rows] = _sample_rows(logits[rows], [requests[i] for i in sampled_rows])
    if raw_logprobs is None:
        return SampledTokens(tokens.tolist(), [None] * len(params))
    chosen = raw_logprobs.gather(1, tokens[logprob_rows][:, None])[:, 0]
    num_top = max(params[i].logprobs for i in logprob_rows)
    top_values, top_ids = raw_logprobs.topk(num_top, dim=-1)
    # Token ids travel as float64, exact up to 2**53: one copy to the host for everything.
    flat = torch.cat([tokens.double(), chosen.double(), top_values.double().flatten(),
                      top_ids.double().flatten()]).tolist()
    k, m = len(params), len(logprob_rows)
    token_ids = [int(t) for t in flat[:k]]
    values = flat[k + m: k + m + m * num_top]
    ids = flat[k + m + m * num_top:]
    logprobs: list[TokenLogprobs | None] = [None] * k
    for j, row in enumerate(logprob_rows):
        top = [(int(ids[j * num_top + c]), values[j * num_top + c])
               for c in range(params[row].logprobs)]
        logprobs[row] = TokenLogprobs(token_ids[row], flat[k + j], top)
    return SampledTokens(token_ids, logprobs)


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
    if entries:
        rows, tokens, biases = zip(*entries, strict=True)
        device = logits.device
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                          torch.tensor(biases, dtype=logits.dtype, device=device),
                          accumulate=True)


def _mask_stops_before_min_tokens(logits: torch.Tensor, requests: Sequence[Request],
                                  eos_token_id: int | None) -> None:
    entries = []
    for row, request in enumerate(requests):
        p = request.params
        if len(request.output_ids) < p.min_tokens:
            stops = list(p.stop_token_ids)
            if eos_token_id is not None and not p.ignore_eos:
                stops.append(eos_token_id)
            entries += [(row, token) for token in stops]
    if entries:
        rows, tokens = zip(*entries, strict=True)
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = \
            float("-inf")


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """vLLM's penalties: a repetition penalty divides a positive logit of a token seen in the
    prompt or the output (multiplies a negative one); frequency and presence penalties
    subtract per occurrence in the output and once for being there at all."""
    rows = [row for row, r in enumerate(requests) if r.params.penalised]
    if not rows:
        return
    vocab_size, device = logits.shape[-1], logits.device
    states = []
    for row in rows:
        request = requests[row]
        if request.penalty_state is None:
            request.penalty_state = PenaltyState.new(request.prompt_ids, vocab_size, device)
        states.append(request.penalty_state)
    counts = torch.stack([s.update(requests[row].output_ids)
                          for s, row in zip(states, rows, strict=True)]).to(logits.dtype)
    present = counts > 0
    index = torch.tensor(rows, device=device)
    x = logits[index]

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(requests[row].params, name) for row in rows],
                            dtype=logits.dtype, device=device)[:, None]

    repetition = column("repetition_penalty")
    if (repetition != 1).any():
        seen = torch.stack([s.prompt_mask for s in states]) | present
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - column("frequency_penalty") * counts - column("presence_penalty") * present
    logits[index] = x


def _sample_rows(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Sampled tokens [m] for rows that all have a temperature > 0."""
    return sample_from_probs(_row_probs(logits, [r.params for r in requests]), requests)


def sampling_probs(logits: torch.Tensor, requests: Sequence[Request],
                   eos_token_id: int | None) -> torch.Tensor:
    """The distributions [k, V] ``sample_batch`` draws rows with a temperature > 0 from: bias,
    stop masks and penalties, then temperature, min-p, top-k and top-p (a speculative step's
    rejection sampling needs the target's probabilities, not only a draw from them)."""
    params = [r.params for r in requests]
    logits = logits.float().clone()
    _apply_logit_bias(logits, params)
    _mask_stops_before_min_tokens(logits, requests, eos_token_id)
    _apply_penalties(logits, requests)
    return _row_probs(logits, params)


def _row_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's distribution after temperature, min-p, top-k and top-p."""
    return _filtered_logits(logits, params).softmax(dim=-1)


def _filtered_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's logits after its temperature, min-p, top-k and top-p (-inf outside)."""
    device, vocab_size = logits.device, logits.shape[-1]
    neg_inf = float("-inf")

    def column(values: list[float]) -> torch.Tensor | float:
        # One value for every row (a static batch's) stays a number: nothing is copied to
        # the device, so a step that samples never waits on a host-to-device copy.
        if all(v == values[0] for v in values):
            return values[0]
        return torch.tensor(values, dtype=logits.dtype, device=device)[:, None]

    logits = logits / column([p.temperature for p in params])
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        threshold = column([p.min_p for p in params]) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, neg_inf)
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    candidates = None  # the top-k logits of every row, sorted, and their token ids
    if min(top_k) < vocab_size:
        # Each row's k-th largest logit (one topk up to the largest k in use); rows without
        # top-k get -inf.
        candidates = torch.topk(logits, max(k for k in top_k if k < vocab_size), dim=-1)
        width = candidates.values.shape[-1]
        if max(top_k) == min(top_k):
            kth = candidates.values[:, width - 1:]
        else:
            kth = candidates.values.gather(1, torch.tensor([min(k, width) - 1 for k in top_k],
                                                           device=device)[:, None])
            kth = kth.masked_fill(torch.tensor(top_k, device=device)[:, None] == vocab_size,
                                  neg_inf)
        logits = logits.masked_fill(logits < kth, neg_inf)
    if min(top_p) < 1.0:
        if max(top_k) < vocab_size:
            # Every row kept at most k tokens: top-p needs only those, already sorted by topk
            # (a sort of the whole vocabulary costs 10x more on a CPU).
            sorted_logits = candidates.values.masked_fill(candidates.values < kth, neg_inf)
            order = candidates.indices
        else:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already hold top_p of the mass; the most
        # likely token is always kept (filter_logits, each row with its own p).
        drop_sorted = probs.cumsum(dim=-1) - probs >= column(top_p)
        drop = torch.zeros(logits.shape, dtype=torch.bool, device=device).scatter(
            -1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    return logits


def sample_from_probs(probs: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """One token per row of ``probs`` [m, V] (unnormalised rows are fine), by the exponential
    race of ``sample``; a seeded row draws from its request's own generator."""
    device, vocab_size = probs.device, probs.shape[-1]
    noise = torch.empty_like(probs)
    shared = [row for row, r in enumerate(requests) if r.params.seed is None
              or r.generator is None]
    if len(shared) == len(requests):
        noise.exponential_()
    else:
        if shared:
            noise[shared] = torch.empty((len(shared), vocab_size), dtype=noise.dtype,
                                        device=device).exponential_()
        for row, request in enumerate(requests):
            if request.params.seed is not None and request.generator is not None:
                noise[row].exponential_(generator=request.generator)
    return _race(probs, noise)
