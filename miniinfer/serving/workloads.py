"""The workloads a serving benchmark replays (chapter 08): ``num_requests`` requests with Poisson
arrivals at ``request_rate`` per second (``inf``: all at once, the offline case), prompt and
output lengths drawn uniformly from ranges, or prompts (and output lengths) sampled from a JSONL
dataset file. Seeded: the same config gives the same requests, token for token, to every
system."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..bench import FIRST_PLAIN_TOKEN
from ..errors import InvalidRequestError
from ..inputs import check_input_file, read_jsonl
from ..models import LoadedModel


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """``prompt_len`` and ``output_len`` are inclusive ranges; with a ``dataset`` the prompts
    come from the file, and so do output lengths where a line gives one."""

    num_requests: int = 32
    request_rate: float = math.inf
    prompt_len: tuple[int, int] = (16, 256)
    output_len: tuple[int, int] = (32, 128)
    dataset: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
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
    arrival = 0.0
    requests = []
    for index in range(config.num_requests):
        if index and math.isfinite(config.request_rate):
            # Poisson arrivals: exponential gaps with mean 1 / rate.
            arrival += rng.expovariate(config.request_rate)
        output_len = rng.randint(*config.output_len)
        if dataset:
            prompt, given = rng.choice(dataset)
            output_len = given or output_len
        else:
            prompt = [rng.randrange(FIRST_PLAIN_TOKEN, lm.config.vocab_size)
                      for _ in range(rng.randint(*config.prompt_len))]
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
