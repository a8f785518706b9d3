"""EOS through the whole path, on the tiny model with an EOS it does emit (``tiny_eos``): every
stage stops a row on it (EOS kept, nothing after it), the continuous engines retire that request
at once with reason EOS while the others go on to their length, and the server says
``"stop"`` for it and ``"length"`` for the rest, in both response shapes."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import EOS_AT, EOS_PROMPTS, TINY_EOS_ID
from test_ch10_server import running_server

from miniinfer import SamplingParams, make_engine
from miniinfer.core.scheduler import FinishReason

MAX_NEW = 8
NAMES = list(EOS_PROMPTS)
PROMPTS = list(EOS_PROMPTS.values())


@pytest.fixture(scope="module")
def greedy(tiny_eos) -> dict[str, list[int]]:
    """Each prompt's first ``MAX_NEW`` greedy tokens, EOS ignored."""
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    ids = make_engine("naive", tiny_eos).generate(PROMPTS, params).token_ids
    return dict(zip(NAMES, ids, strict=True))


def until_eos(name: str, greedy: dict[str, list[int]]) -> list[int]:
    at = EOS_AT[name]
    return greedy[name] if at is None else greedy[name][: at + 1]


STAGES = ["hf", "naive", "paged-loop", "paged-vectorized", "paged-prealloc", "paged-attention",
          "async:sync", "async:overlap", "continuous", "prefix-cache"]


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_stops_a_row_at_its_eos(stage, tiny_eos, greedy):
    engine = make_engine(stage, tiny_eos)
    stopped = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW)).token_ids
    assert stopped == [until_eos(name, greedy) for name in NAMES]
    assert [ids[-1] == TINY_EOS_ID for ids in stopped] == [True, True, False]
    ignored = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW,
                                                      ignore_eos=True)).token_ids
    assert ignored == [greedy[name] for name in NAMES]


@pytest.mark.parametrize("stage", ["continuous", "prefix-cache"])
def test_continuous_engines_retire_an_eos_request_at_once(stage, tiny_eos, greedy):
    engine = make_engine(stage, tiny_eos)
    manager = engine.kv_cache.block_manager
    ids = {name: engine.add_request(prompt, SamplingParams(max_new_tokens=MAX_NEW),
                                    request_id=name)
           for name, prompt in EOS_PROMPTS.items()}
    finished_at: dict[str, int] = {}
    reasons: dict[str, FinishReason] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for request in engine.step().outputs:
            if request.finished:
                finished_at[request.request_id] = step
                reasons[request.request_id] = request.finish_reason
                assert request.request_id not in manager  # its blocks are back at once
                assert request.output_ids == until_eos(request.request_id, greedy)
    # One step of prefill gives every first token; a request's k-th token comes at step k.
    assert finished_at == {"first": 1, "fifth": 5, "never": MAX_NEW}
    assert reasons == {"first": FinishReason.EOS, "fifth": FinishReason.EOS,
                       "never": FinishReason.LENGTH}
    assert set(ids.values()) == set(NAMES) and manager.num_free_blocks == manager.num_blocks


def test_ignore_eos_runs_to_the_length(tiny_eos, greedy):
    engine = make_engine("continuous", tiny_eos)
    engine.add_request(EOS_PROMPTS["first"], SamplingParams(max_new_tokens=3, ignore_eos=True),
                       request_id="r")
    while engine.has_unfinished_requests():
        outputs = engine.step().outputs
    assert outputs[0].finish_reason is FinishReason.LENGTH
    assert outputs[0].output_ids == greedy["first"][:3] == [TINY_EOS_ID] * 3


@pytest.fixture(scope="module")
def eos_server(tiny_eos):
    with running_server(tiny_eos) as running:
        yield running


def post(server, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("name, reason", [("first", "stop"), ("fifth", "stop"),
                                          ("never", "length")])
def test_server_reports_stop_for_eos_and_length_for_max_tokens(name, reason, eos_server,
                                                               tiny_eos, greedy):
    ids = until_eos(name, greedy)
    body = post(eos_server, {"model": "tiny", "prompt": EOS_PROMPTS[name],
                             "max_tokens": MAX_NEW, "temperature": 0})
    choice = body["choices"][0]
    assert choice["finish_reason"] == reason
    assert body["usage"]["completion_tokens"] == len(ids)
    # The EOS counts as a token but is not text, as with a real EOS.
    assert choice["text"] == tiny_eos.tokenizer.decode(ids, skip_special_tokens=True)
    assert "<jupyter_start>" not in choice["text"]


def test_server_streams_the_eos_finish_reason(eos_server, tiny_eos, greedy):
    body = {"model": "tiny", "prompt": EOS_PROMPTS["fifth"], "max_tokens": MAX_NEW,
            "temperature": 0, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{eos_server.base_url}/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "stop" and set(reasons[:-1]) <= {None}
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == tiny_eos.tokenizer.decode(until_eos("fifth", greedy), skip_special_tokens=True)


def test_server_ignore_eos_runs_to_max_tokens(eos_server, greedy):
    body = post(eos_server, {"model": "tiny", "prompt": EOS_PROMPTS["fifth"],
                             "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == MAX_NEW
