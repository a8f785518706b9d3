"""Shared fixtures. The real SmolLM2 is loaded once per session (about a second from the
cache; the first run ever converts the GGUF, about 20 s)."""

from __future__ import annotations

import dataclasses
import signal
from typing import NamedTuple

import pytest

from miniinfer import SamplingParams, load_model, make_engine

# The Ctrl-C tests send SIGINT to this process and to CLI children. A shell that starts the
# suite in the background (`make test &`, nohup) makes it ignore SIGINT, and children inherit
# that: the interrupt never lands and those tests wait out their 600 s limits. Python's own
# handler here gives the same start whoever launched the suite (children get the default back
# at exec, since a handler, unlike an ignore, does not survive it).
signal.signal(signal.SIGINT, signal.default_int_handler)

# Texts of different lengths, plain and chat-formatted, so a batch mixes lengths and padding.
TEXTS = [
    "The capital of France is",
    "Hello",
    "Write a haiku about the sea, the moon and the stars, please:",
    "1, 2, 3, 4,",
    "Question: what is 2 + 2? Answer:",
    "Once upon a time, in a small village by the river, there lived",
    "def fibonacci(n):",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]
LONG_TEXT = ("The history of computing is a story of ideas meeting machines. Early calculators "
             "were mechanical, then electrical, and finally electronic; each step made them "
             "faster, smaller and cheaper, until a computer fitted in a pocket.")
# Prompt lengths that end exactly on a KV block boundary (block size 16) and one token past it.
BOUNDARY_LENGTHS = (16, 17, 32, 33)
NEW_TOKENS = 32


@pytest.fixture(scope="session")
def smollm2():
    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def tiny():
    return load_model("tiny", device="cpu")


@pytest.fixture(scope="session")
def template_prompts(smollm2) -> list[list[int]]:
    """>= 8 prompts of mixed lengths, including block-boundary lengths."""
    tok = smollm2.tokenizer
    long_ids = tok.encode(LONG_TEXT)
    assert len(long_ids) > max(BOUNDARY_LENGTHS)
    return [tok.encode(t) for t in TEXTS] + [long_ids[:n] for n in BOUNDARY_LENGTHS]


@pytest.fixture(scope="session")
def hf_greedy(smollm2, template_prompts) -> dict[str, list[list[int]]]:
    """HF generate's greedy tokens: the whole batch at once (left padding) and each prompt alone.
    Computed once and shared by every stage's template test."""
    hf = make_engine("hf", smollm2)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return {
        "batched": hf.generate(template_prompts, params).token_ids,
        "single": [hf.generate([p], params).token_ids[0] for p in template_prompts],
    }


class EOSCase(NamedTuple):
    prompts: list[list[int]]
    params: SamplingParams
    hf_batched: list[list[int]]  # HF's tokens for both prompts at once
    hf_alone: list[int]  # HF's tokens for the chat prompt alone


@pytest.fixture(scope="session")
def hf_eos(smollm2) -> EOSCase:
    """The EOS case every stage's test reuses, with HF's tokens computed once: the chat prompt
    makes the model answer briefly and end its turn with <|im_end|> (33 tokens); "Hello" beside
    it runs to max_new_tokens, so a batch holds a finished and a running request."""
    tok = smollm2.tokenizer
    prompts = [tok.encode("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"),
               tok.encode("Hello")]
    params = SamplingParams(max_new_tokens=48)
    hf = make_engine("hf", smollm2)
    batched = hf.generate(prompts, params).token_ids
    alone = hf.generate(prompts[:1], params).token_ids[0]
    assert batched[0][-1] == smollm2.eos_token_id and len(batched[0]) < params.max_new_tokens
    assert len(batched[1]) == params.max_new_tokens and alone[-1] == smollm2.eos_token_id
    return EOSCase(prompts, params, batched, alone)


# The tiny random model copies its input more than it writes: most prompts make it repeat one
# token forever, so with SmolLM2's EOS it never stops. With <jupyter_start> (id 11, a special
# token, dropped from decoded text like a real EOS) as its EOS, found by trying: greedy
# decoding of [7275] emits EOS first, of [12482] fifth, and of [1630] never.
TINY_EOS_ID = 11
EOS_PROMPTS = {"first": [7275], "fifth": [12482], "never": [1630]}
EOS_AT = {"first": 0, "fifth": 4, "never": None}


@pytest.fixture(scope="session")
def tiny_eos(tiny):
    """``tiny`` (same weights) that stops on ``TINY_EOS_ID``; checked to still do what
    ``EOS_AT`` says, so that a change to the model cannot quietly leave EOS untested."""
    lm = dataclasses.replace(tiny, eos_token_id=TINY_EOS_ID)
    greedy = make_engine("naive", lm).generate(
        list(EOS_PROMPTS.values()), SamplingParams(max_new_tokens=8, ignore_eos=True)).token_ids
    found = {name: ids.index(TINY_EOS_ID) if TINY_EOS_ID in ids else None
             for name, ids in zip(EOS_PROMPTS, greedy, strict=True)}
    assert found == EOS_AT, f"the tiny model no longer emits EOS where it did: {found}"
    return lm


def scheduler_step(scheduler) -> tuple[list[tuple[str, int]], list[str]]:
    """One scheduler step as the engine runs it, with token 0 as every sample: returns (request
    id, tokens fed) of what was scheduled and the ids preempted."""
    from miniinfer.core.scheduler import FinishReason

    batch = scheduler.schedule()
    for request, n in batch.scheduled:
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.output_ids.append(0)
            if len(request.output_ids) >= request.params.max_new_tokens:
                scheduler.finish(request, FinishReason.LENGTH, 0.0)
    return ([(r.request_id, n) for r, n in batch.scheduled],
            [r.request_id for r in batch.preempted])
