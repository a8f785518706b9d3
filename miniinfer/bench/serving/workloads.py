"""The workloads a serving benchmark replays (chapter 08): ``num_requests`` requests with Poisson
arrivals at ``request_rate`` per second (``inf``: all at once, the offline case), prompt and
output lengths drawn uniformly from ranges, or prompts (and output lengths) sampled from a JSONL
dataset file. Seeded: the same config gives the same requests, token for token, to every
system.

Chapter 09 adds two kinds of workload whose prompts share their beginnings (``kind``):

- ``shared-prefix``: one system prompt of ``shared_prefix_len`` random tokens, then a question of
  ``prompt_len`` tokens of its own for every request;
- ``multi-turn``: ``num_requests / turns`` conversations of ``turns`` turns. A conversation
  starts at its (Poisson) arrival and its user sends turn k + 1 ``turn_gap_s`` seconds after
  turn k. Turn k + 1's prompt is the conversation so far: every earlier user message (each of
  ``prompt_len`` tokens), each followed by the reply of that turn, then the new message. The
  replies are scripted (random tokens of the turn's output length, like a logged chat being
  replayed), not what the system generated, so every system gets the same prompts at the same
  times; what one turn can reuse of the next is therefore its own prompt, not its reply.

``random`` (the default) shares nothing: chapter 08's workload.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import InvalidRequestError
from ...core.models import LoadedModel
from ..inputs import check_input_file, read_jsonl
from ..offline import FIRST_PLAIN_TOKEN

WORKLOAD_KINDS = ("random", "shared-prefix", "multi-turn")


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """``prompt_len`` and ``output_len`` are inclusive ranges; with a ``dataset`` the prompts
    come from the file, and so do output lengths where a line gives one. ``kind`` and the
    fields after it: see the module docstring (``prompt_len`` is then a question's or a user
    message's length)."""

    num_requests: int = 32
    request_rate: float = math.inf
    prompt_len: tuple[int, int] = (16, 256)
    output_len: tuple[int, int] = (32, 128)
    dataset: str | None = None
    seed: int = 0
    kind: str = "random"
    shared_prefix_len: int = 512
    turns: int = 4
    turn_gap_s: float = 5.0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise InvalidRequestError(f"unknown workload {self.kind!r}; workloads: "
                                      f"{', '.join(WORKLOAD_KINDS)}")
        if self.dataset is not None and self.kind != "random":
            raise InvalidRequestError(f"a dataset gives its own prompts; workload {self.kind!r} "
                                      f"makes them")
        if not isinstance(self.shared_prefix_len, int) or self.shared_prefix_len < 0:
            raise InvalidRequestError(f"shared_prefix_len must be an integer >= 0, got "
                                      f"{self.shared_prefix_len!r}")
        if not isinstance(self.turns, int) or self.turns < 1 or not self.turn_gap_s >= 0:
            raise InvalidRequestError(f"need turns >= 1 and turn_gap_s >= 0, got "
                                      f"{self.turns!r} and {self.turn_gap_s!r}")
        if self.kind == "multi-turn" and self.num_requests % self.turns:
            raise InvalidRequestError(f"multi-turn: num_requests ({self.num_requests}) must be "
                                      f"a multiple of turns ({self.turns})")
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise InvalidRequestError(f"num_requests must be >= 1, got {self.num_requests!r}")
        if not self.request_rate > 0:
            raise InvalidRequestError(f"request_rate must be > 0 (inf: all at once), got "
                                      f"{self.request_rate!r}")
        if self.dataset is not None:
            check_input_file(self.dataset, "dataset file")
        for name in ("prompt_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise InvalidRequestError(f"{name} must be a range 1 <= low <= high, got "
                                          f"{low}-{high}")


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    index: int
    arrival_s: float  # after the start of the run
    prompt_ids: list[int]
    max_new_tokens: int
    conversation: int = 0  # multi-turn: which conversation and which turn (from 1)
    turn: int = 1


def read_dataset_texts(path: str | Path) -> list[tuple[str, int | None]]:
    """A JSONL file, one ``{"prompt": text, "output_len": n}`` per line (``output_len``
    optional): the prompts and their output lengths, every line checked (no model needed, so
    the CLI reads it before loading one)."""
    items = []
    for n, item in read_jsonl(path, "dataset file"):
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) \
                or not item["prompt"].strip():
            raise InvalidRequestError(f'{path}:{n} needs a non-empty string "prompt"')
        output_len = item.get("output_len")
        if output_len is not None and (not isinstance(output_len, int)
                                       or isinstance(output_len, bool) or output_len < 1):
            raise InvalidRequestError(f'{path}:{n}: "output_len" must be an integer >= 1')
        items.append((item["prompt"], output_len))
    return items


def read_dataset(path: str | Path, tokenizer) -> list[tuple[list[int], int | None]]:
    """``read_dataset_texts`` with the prompts tokenized."""
    return [(tokenizer.encode(text), output_len) for text, output_len in read_dataset_texts(path)]


def make_workload(lm: LoadedModel, config: WorkloadConfig) -> list[WorkloadRequest]:
    rng = random.Random(config.seed)
    dataset = read_dataset(config.dataset, lm.tokenizer) if config.dataset else None

    def random_tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_PLAIN_TOKEN, lm.config.vocab_size) for _ in range(n)]

    system_prompt = random_tokens(config.shared_prefix_len) if config.kind == "shared-prefix" \
        else []
    multi_turn = config.kind == "multi-turn"
    arrival = 0.0
    requests: list[WorkloadRequest] = []
    for index in range(config.num_requests // config.turns if multi_turn else config.num_requests):
        if index and math.isfinite(config.request_rate):
            # Poisson arrivals: exponential gaps with mean 1 / rate.
            arrival += rng.expovariate(config.request_rate)
        if multi_turn:
            requests += _conversation(config, rng, random_tokens, index, arrival, len(requests))
            continue
        output_len = rng.randint(*config.output_len)
        if dataset:
            prompt, given = rng.choice(dataset)
            output_len = given or output_len
        else:
            prompt = system_prompt + random_tokens(rng.randint(*config.prompt_len))
        requests.append(WorkloadRequest(index, arrival, list(prompt), output_len))
    return requests


def check_workload(lm: LoadedModel, workload: Sequence[WorkloadRequest]) -> None:
    """Every request must fit the model's context with all its output tokens: checked once for
    every system before any serves (some would reject a request mid-run, transformers' would
    serve it past the model's positions)."""
    for w in workload:
        need = len(w.prompt_ids) + w.max_new_tokens
        if need > lm.max_context:
            raise InvalidRequestError(
                f"workload request {w.index} has {len(w.prompt_ids)} prompt tokens and "
                f"{w.max_new_tokens} output tokens: {need} positions, more than the model's "
                f"context of {lm.max_context}")


def _conversation(config: WorkloadConfig, rng: random.Random,
                  random_tokens: Callable[[int], list[int]], conversation: int, start: float,
                  first_index: int) -> list[WorkloadRequest]:
    """One conversation's turns, each prompt the whole conversation so far."""
    requests = []
    history: list[int] = []
    for turn in range(1, config.turns + 1):
        history += random_tokens(rng.randint(*config.prompt_len))
        output_len = rng.randint(*config.output_len)
        requests.append(WorkloadRequest(first_index + turn - 1,
                                        start + (turn - 1) * config.turn_gap_s, list(history),
                                        output_len, conversation, turn))
        history += random_tokens(output_len)  # the scripted reply
    return requests
