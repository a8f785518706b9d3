"""Chapter 10: the server as the field's own clients drive it (issue 28).

- the exact bodies ``vllm bench serve --backend openai`` and ``--backend openai-chat`` send
  (captured in tests/fixtures from vLLM's benchmark client) are served, streamed, to the end;
- unknown fields are accepted and logged once (vLLM's behaviour), or refused with
  ``--strict-fields``;
- the official ``openai`` client uses vLLM's extras: n > 1 with logprobs in a stream, a list
  of prompts, best_of, echo, penalties that change the output the way they should;
- the endpoints clients probe: /health, /version, /v1/models, /tokenize, /detokenize and
  /metrics under vLLM's names (prefix-cache hits counted for real);
- n > 1 on the prefix-cache engine shares the prompt's KV blocks (measured).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import TEXTS
from server_helpers import running_server, scrape

from miniinfer.server import ServerProcess

FIXTURE = json.loads((Path(__file__).parent / "fixtures" /
                      "vllm_bench_serve_bodies.json").read_text())


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(tiny) as running:
        yield running


@pytest.fixture(scope="module")
def strict_server(tiny):
    with running_server(tiny, strict_fields=True) as running:
        yield running


def read_like_vllm_bench(response: httpx.Response, chat: bool) -> dict:
    """What vLLM's request function takes from a stream: it succeeds when a chunk with
    choices arrives; it reads the text from each, and completion_tokens from the usage."""
    assert response.status_code == 200, response.read()
    text, chunks, usage, done = "", 0, None, False
    for line in response.iter_lines():
        if not line:
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        assert "error" not in chunk, chunk
        if chunk.get("choices"):
            chunks += 1
            choice = chunk["choices"][0]
            text += (choice["delta"].get("content") if chat else choice.get("text")) or ""
        elif chunk.get("usage"):
            usage = chunk["usage"]
    return {"text": text, "chunks": chunks, "usage": usage, "done": done}


@pytest.mark.parametrize("backend,path", [("openai", "/completions"),
                                          ("openai-chat", "/chat/completions")])
@pytest.mark.parametrize("which", ["server", "strict_server"])
def test_vllm_bench_serve_bodies_are_served(request, backend, path, which):
    # Every field vLLM's client sends is one we know: a strict server serves them too.
    running = request.getfixturevalue(which)
    for body in FIXTURE[backend]:
        with httpx.stream("POST", running.base_url + path, content=json.dumps(body).encode(),
                          headers={"content-type": "application/json"}, timeout=60) as response:
            got = read_like_vllm_bench(response, chat=backend == "openai-chat")
        assert got["chunks"] >= 1 and got["done"]
        tokens = body.get("max_tokens") or body["max_completion_tokens"]
        assert 1 <= got["usage"]["completion_tokens"] <= tokens
        if body.get("ignore_eos"):
            assert got["usage"]["completion_tokens"] == tokens


def test_unknown_fields_are_accepted_and_logged_once(server, caplog):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "colour": "red",
            "nested_thing": {"a": 1}}
    with caplog.at_level(logging.WARNING, logger="miniinfer.server"):
        for _ in range(3):
            response = httpx.post(server.base_url + "/completions", json=body)
            assert response.status_code == 200, response.text
    logged = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(logged) == 1 and "'colour'" in logged[0] and "'nested_thing'" in logged[0]
    # A message field nobody defines is found too.
    chat = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi", "mood": "happy"}]}
    with caplog.at_level(logging.WARNING, logger="miniinfer.server"):
        assert httpx.post(server.base_url + "/chat/completions", json=chat).status_code == 200
    assert any("'messages.0.mood'" in r.getMessage() for r in caplog.records)


def test_strict_fields_refuses_unknown_fields(strict_server):
    response = httpx.post(strict_server.base_url + "/completions",
                          json={"model": "tiny", "prompt": "Hello", "colour": "red"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "colour" and "unrecognized" in error["message"]
    response = httpx.post(strict_server.base_url + "/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi", "mood": "happy"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == \
        "messages.0.mood"


def test_n2_with_logprobs_streamed_by_the_official_client(server):
    client = server.client()
    chunks = list(client.completions.create(
        model="tiny", prompt=TEXTS[0], max_tokens=6, temperature=1.0, seed=3, n=2, logprobs=3,
        stream=True, extra_body={"ignore_eos": True}))
    by_choice: dict[int, list] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            by_choice[choice.index].append(choice)
    for pieces in by_choice.values():
        tokens = [t for c in pieces if c.logprobs for t in c.logprobs.tokens]
        logprobs = [x for c in pieces if c.logprobs for x in c.logprobs.token_logprobs]
        tops = [x for c in pieces if c.logprobs for x in c.logprobs.top_logprobs]
        assert len(tokens) == len(logprobs) == len(tops) == 6
        assert all(lp <= 0 for lp in logprobs)
        # The sampled token and the 3 most likely ones (one entry fewer when it is among them).
        assert all(3 <= len(top) <= 4 for top in tops)
        assert all(top[t] == lp for top, t, lp in zip(tops, tokens, logprobs, strict=True))
        assert "".join(c.text for c in pieces) == "".join(tokens)
        assert pieces[-1].finish_reason == "length"
    # The whole answer repeats, and the two choices (seeds 3 and 4) differ.
    whole = client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=6,
                                      temperature=1.0, seed=3, n=2,
                                      extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert texts == ["".join(c.text for c in by_choice[i]) for i in (0, 1)]
    assert texts[0] != texts[1]


def test_chat_logprobs_and_top_logprobs_in_openai_shape(server):
    client = server.client()
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and bytes(entry.bytes).decode() == entry.token
        # Greedy: the sampled token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    streamed = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, stream=True,
        extra_body={"ignore_eos": True}))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in entries] == \
        [(e.token, round(e.logprob, 5)) for e in content]


def test_a_list_of_prompts_gets_one_choice_each(server, tiny):
    client = server.client()
    prompts = [TEXTS[0], TEXTS[3], TEXTS[6]]
    batched = client.completions.create(model="tiny", prompt=prompts, max_tokens=5,
                                        temperature=0, n=2)
    assert [c.index for c in batched.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                          temperature=0)
        # Greedy: both choices of prompt i equal the prompt sent alone.
        assert [batched.choices[2 * i + j].text for j in (0, 1)] == [alone.choices[0].text] * 2
    assert batched.usage.prompt_tokens == sum(len(tiny.tokenizer.encode(p)) for p in prompts)
    ids = [tiny.tokenizer.encode(p) for p in prompts[:2]]
    as_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in as_ids.choices] == [batched.choices[0].text, batched.choices[2].text]


def test_echo_and_max_completion_tokens(server):
    client = server.client()
    out = client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=3, temperature=0,
                                    echo=True, extra_body={"max_completion_tokens": 5,
                                                           "ignore_eos": True})
    assert out.choices[0].text.startswith(TEXTS[0])
    assert out.usage.completion_tokens == 5  # max_completion_tokens wins over max_tokens
    streamed = list(client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=5,
                                              temperature=0, echo=True, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                   "content": "Hi"}],
                                          max_completion_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3


def test_best_of_returns_the_most_likely_choices(server):
    client = server.client()
    args = dict(model="tiny", prompt=TEXTS[2], max_tokens=4, temperature=1.0, seed=5,
                extra_body={"ignore_eos": True})
    best = client.completions.create(**args, n=1, best_of=4, logprobs=0)
    every = client.completions.create(**args, n=4, logprobs=0)
    totals = sorted((sum(c.logprobs.token_logprobs), c.text) for c in every.choices)
    assert best.choices[0].text == totals[-1][1]
    assert best.usage.completion_tokens == 16  # all four were generated


def test_penalties_change_the_output_the_way_they_should(server):
    """The tiny random model repeats itself greedily; a frequency penalty breaks repeats, a
    repetition penalty keeps the prompt's tokens out, a logit bias forces a token."""
    client = server.client()

    def token_ids(**extra) -> list[int]:
        out = client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True,
                                                                   "return_token_ids": True,
                                                                   **extra})
        return out.choices[0].model_extra["token_ids"]

    plain = token_ids()
    most_repeated = Counter(plain).most_common(1)[0][1]
    assert most_repeated > 3, f"the greedy output does not repeat: {plain}"
    assert Counter(token_ids(frequency_penalty=2.0)).most_common(1)[0][1] < most_repeated
    assert Counter(token_ids(presence_penalty=2.0)).most_common(1)[0][1] < most_repeated
    repeated = Counter(token_ids(frequency_penalty=-2.0)).most_common(1)[0][1]
    assert repeated >= most_repeated  # a negative penalty rewards repeats
    biased = token_ids(logit_bias={"42": 100})
    assert biased == [42] * 24
    assert set(token_ids(logit_bias={str(t): -100 for t in set(plain)})).isdisjoint(plain)


def test_stop_token_ids_min_tokens_and_skip_special_tokens(server):
    client = server.client()
    plain = client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=10,
                                      temperature=0, extra_body={"ignore_eos": True,
                                                                 "return_token_ids": True})
    ids = plain.choices[0].model_extra["token_ids"]
    stop_at = ids[3]
    cut = client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=10, temperature=0,
                                    extra_body={"stop_token_ids": [stop_at],
                                                "return_token_ids": True})
    got = cut.choices[0].model_extra["token_ids"]
    assert got == ids[: ids.index(stop_at) + 1] and cut.choices[0].finish_reason == "stop"
    late = client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=10,
                                     temperature=0, extra_body={"stop_token_ids": [stop_at],
                                                                "min_tokens": 8,
                                                                "return_token_ids": True})
    assert len(late.choices[0].model_extra["token_ids"]) >= 8
    assert stop_at not in late.choices[0].model_extra["token_ids"][:8]
    # Token 1 is <|im_start|>, a special token: shown only when asked for.
    forced = dict(max_tokens=2, temperature=0, extra_body={"logit_bias": {"1": 100}})
    shown = client.completions.create(model="tiny", prompt="Hi", **forced | {
        "extra_body": {"logit_bias": {"1": 100}, "skip_special_tokens": False}})
    hidden = client.completions.create(model="tiny", prompt="Hi", **forced)
    assert shown.choices[0].text == "<|im_start|><|im_start|>" and hidden.choices[0].text == ""


def test_probed_endpoints(server, tiny):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = httpx.get(server.base_url + "/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", tiny.max_context)]
    text = "Hello world, tokenize me."
    ids = tiny.tokenizer.encode(text)
    got = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": text,
                                                     "return_token_strs": True}).json()
    assert got["tokens"] == ids and got["count"] == len(ids)
    assert got["max_model_len"] == tiny.max_context
    assert got["token_strs"] == tiny.tokenizer.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    rendered = tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
    assert chat["tokens"] == tiny.tokenizer.encode(rendered)
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json() == \
        {"prompt": text}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_metrics_have_vllm_names_and_prefix_cache_hits_are_real(tiny):
    with running_server(tiny, engine="prefix-cache") as running:
        client = running.client()
        shared = " ".join(TEXTS)  # 5+ blocks of a prompt every request starts with
        before = running.metrics()
        for question in ("Who?", "What?", "Where?"):
            client.completions.create(model="tiny", prompt=shared + question, max_tokens=2,
                                      temperature=0)
        after = scrape(running.url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name in after, name
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    num_shared = len(tiny.tokenizer.encode(shared)) // 16 * 16
    # The first request finds nothing; the two after it find the shared prompt's full blocks.
    assert hits >= 2 * (num_shared - 16) and 0 < hits / queries < 1


def test_n4_shares_the_prompts_kv_blocks(tiny):
    """n=4 on the prefix-cache engine against 4 separate requests sent at once: the choices
    after the first wait for its prompt and find its full blocks cached."""
    prompt = " ".join(TEXTS)
    args = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=1,
                extra_body={"ignore_eos": True})

    def peak_blocks(running, send) -> int:
        engine = running.engine
        engine.reset_prefix_cache()
        peak = 0
        step = engine.step

        def recording_step():
            nonlocal peak
            result = step()
            peak = max(peak, result.num_blocks_in_use)
            return result

        engine.step = recording_step
        try:
            send(running.client())
        finally:
            engine.step = step
        return peak

    with running_server(tiny, engine="prefix-cache", arrival_window_ms=50) as running:
        shared = peak_blocks(running, lambda c: c.completions.create(**args, n=4))
        separate = peak_blocks(running, lambda c: _at_once(c, args, 4))
    num_prompt_blocks = -(-len(tiny.tokenizer.encode(prompt)) // 16)
    print(f"peak KV blocks: n=4 {shared}, 4 separate requests {separate} "
          f"(prompt: {num_prompt_blocks} blocks)")
    assert separate >= 4 * num_prompt_blocks
    # The prompt's full blocks once, plus each choice's own last block(s).
    assert shared <= num_prompt_blocks + 4 * 2 < separate


def _at_once(client, args: dict, count: int) -> None:
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(lambda _: client.completions.create(**args), range(count)))


def test_continuous_usage_stats_seeded_chat_and_many_stop_strings(server, tiny):
    client = server.client()
    chunks = list(client.completions.create(
        model="tiny", prompt=TEXTS[0], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == [1, 2, 3, 4] and chunks[-1].usage.completion_tokens == 4
    messages = [{"role": "user", "content": "Tell me a story."}]
    args = dict(model="tiny", messages=messages, max_tokens=8, temperature=1.0, seed=11)
    assert client.chat.completions.create(**args).choices[0].message.content == \
        client.chat.completions.create(**args).choices[0].message.content
    # More than OpenAI's 4 stop strings, as vLLM takes them: the one that occurs cuts.
    full = client.completions.create(model="tiny", prompt=TEXTS[2], max_tokens=24,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"the greedy text is too short to cut: {full!r}"
    stops = ["never-1", "never-2", "never-3", "never-4", "never-5", stop]
    cut = client.completions.create(model="tiny", prompt=TEXTS[2], max_tokens=24,
                                    temperature=0, stop=stops)
    assert cut.choices[0].text == full[: full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_serve_flags_strict_fields_and_max_request_bytes():
    with ServerProcess("tiny", "--device", "cpu", "--strict-fields",
                       "--max-request-bytes", "2000") as proc:
        unknown = httpx.post(proc.base_url + "/completions",
                             json={"model": "tiny", "prompt": "hi", "colour": "red"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "colour"
        big = httpx.post(proc.base_url + "/completions",
                         json={"model": "tiny", "prompt": "hi " * 1000})
        assert big.status_code == 413
        ok = httpx.post(proc.base_url + "/completions",
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_a_chat_choice_opens_with_its_role_when_its_first_tokens_are_out(server):
    """The role chunk of each chat choice comes right before that choice's first text (as
    vLLM's server sends it), never on arrival: clients time the first token at the first
    chunk, and a role sent before the prefill would read as a TTFT of no time."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 3, "stream": True}
    events = []
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    delta = choice["delta"]
                    # Text deltas carry no role (and exclude_none leaves it out).
                    events.append((choice["index"], "role" if delta.get("role") else "text"))
    for index in (0, 1):
        mine = [kind for i, kind in events if i == index]
        assert mine[0] == "role" and mine.count("role") == 1 and "text" in mine
        first = events.index((index, "role"))
        # Nothing of another choice between this choice's role and its first text.
        assert events[first + 1] == (index, "text"), events
