"""Chapter 10: no request can crash, stall or exhaust the server (issue 28, item 4).

Every malformed body gets a 4xx in OpenAI's shape and the server serves on; a body over
``--max-request-bytes`` is refused with a 413 before it is read whole; a prompt too long for
the context is refused before it is tokenised (or as soon as its pieces pass the context),
and tokenising runs in worker threads; a KV pool that cannot hold one full context is an error
before the model loads. A fuzz test posts generated and mutated bodies; a load test posts the
largest allowed body while 16 streams run."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time

import httpx
import pytest
from conftest import TEXTS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import running_server

from miniinfer import InvalidRequestError
from miniinfer.cli import main
from miniinfer.server import ServerConfig, ServerProcess
from miniinfer.server import app as server_app
from miniinfer.server.tokens import PromptTokenizer

SMALL_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(tiny, max_request_bytes=SMALL_LIMIT) as running:
        yield running


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if status is not None:
        assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def post(running, path: str, content: bytes, **kwargs) -> httpx.Response:
    return httpx.post(running.base_url + path, content=content,
                      headers={"content-type": "application/json"}, timeout=60, **kwargs)


C = b'{"model":"tiny","max_tokens":2,"prompt":'  # a completions body, up to its prompt
M = b'{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":'  # chat, content
COMPLETION_BODIES = [  # (raw body, what it tests)
    (b"", "empty body"),
    (b"null", "JSON null"),
    (b"42", "a number"),
    (b'"text"', "a string"),
    (b"[]", "an array"),
    (C + b'"hi"} trailing', "garbage after the object"),
    (C + b"[" * 5000 + b"]" * 5000 + b"}", "nesting 5000 deep"),
    (C + b'"hi","x":' + b'{"a":' * 1000 + b"1" + b"}" * 1000 + b"}", "deep unknown field"),
    (C + b'"hi","max_tokens":' + b"9" * 400 + b"}", "a 400-digit integer"),
    (C + b'"hi","max_tokens":' + str(10**30).encode() + b"}", "a 31-digit max_tokens"),
    (C + b"[" + str(10**30).encode() + b"]}", "a 31-digit token id"),
    (C + b'"hi","seed":' + str(2**70).encode() + b"}", "a seed beyond 64 bits"),
    (C + b'"hi","n":' + str(10**20).encode() + b"}", "a huge n"),
    (C + b'"hi","temperature":1e400}', "a float that overflows"),
    (C + b'"hi","temperature":NaN}', "NaN"),
    (C + b'"hi","logit_bias":{"5":1e300}}', "a huge bias"),
    (C + b'"a\xffb"}', "invalid UTF-8 in the prompt"),
    (C + b'"a\xc0\xafb"}', "overlong UTF-8 in the prompt"),
    (C + b'"a\xed\xa0\x80b"}', "an encoded surrogate in the prompt"),
    (C + b'"a\\ud800b"}', "a lone surrogate escape in the prompt"),
    (C + b'"a\\udc00"}', "a lone low surrogate escape in the prompt"),
    (C + b'"hi","\\ud800":1}', "a lone surrogate in a field name"),
    (C + b'"hi","\xff":1}', "invalid UTF-8 in a field name"),
    (C + b'"hi","stop":["\\ud800"]}', "a lone surrogate in a stop string"),
    (C + b'"hi","stop":["a\xff"]}', "invalid UTF-8 in a stop string"),
    (C + b'"hi","user":"\\udfff"}', "a lone surrogate in user"),
    (C + b'"hi","max_tokens":1.5}', "a float max_tokens"),
    (C + b'"hi","max_tokens":true}', "a bool max_tokens"),
    (C + b'"hi","max_tokens":"8"}', "a string max_tokens"),
    (C + b'"hi","max_tokens":[]}', "a list max_tokens"),
    (C + b'"hi","n":2.5}', "a fraction n"),
    (C + b'"hi","seed":1.5}', "a fraction seed"),
    (C + b'"hi","top_k":5.5}', "a fraction top_k"),
    (C + b'"hi","temperature":true}', "a bool temperature"),
    (C + b'"hi","temperature":"0.5"}', "a string temperature"),
    (C + b'"hi","stream":1}', "an int stream"),
    (C + b'"hi","stream":"yes"}', "a string stream"),
    (C + b'"hi","logprobs":true}', "a bool logprobs on completions"),
    (C + b'"hi","echo":null,"logprobs":1.5}', "a fraction logprobs"),
    (C + b'5}', "an int prompt"),
    (C + b'true}', "a bool prompt"),
    (C + b'{}}', "an object prompt"),
    (C + b'null}', "a null prompt"),
    (C + b'[[]]}', "an empty token list"),
    (C + b'[1,[2]]}', "mixed ids and lists"),
    (C + b'[true]}', "a bool token id"),
    (C + b'[-1]}', "a negative token id"),
    (C + b'"hi","stop":5}', "an int stop"),
    (C + b'"hi","stop":[1]}', "int stop strings"),
    (C + b'"hi","logit_bias":[1]}', "a list logit_bias"),
    (C + b'"hi","logit_bias":{"5":"x"}}', "a string bias"),
    (C + b'"hi","stream_options":true,"stream":true}', "a bool stream_options"),
    (C + b'"hi","response_format":{"type":"yaml"}}', "an unknown response_format"),
    (b'{"model":5,"prompt":"hi"}', "an int model"),
    (b'{"model":"","prompt":"hi"}', "an empty model"),
    (b'{"model":"tiny","prompt":"hi","user":5}', "an int user"),
]
CHAT_BODIES = [
    (M + b'"a\xffb"}]}', "invalid UTF-8 in message content"),
    (M + b'"a\\ud800b"}]}', "a lone surrogate in message content"),
    (M + b'[{"type":"text","text":"\\udbff"}]}]}', "a lone surrogate in a content part"),
    (M + b'"hi","\\ud800":1}]}', "a lone surrogate in a message field name"),
    (M + b'5}]}', "an int content"),
    (M + b'[{"type":"text","text":5}]}]}', "an int text part"),
    (b'{"model":"tiny","messages":"hi"}', "messages as a string"),
    (b'{"model":"tiny","messages":[1]}', "a number as a message"),
    (b'{"model":"tiny","messages":[{"content":"hi"}]}', "a message without a role"),
    (b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"logprobs":2}',
     "an int logprobs on chat"),
    (b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":0}',
     "max_completion_tokens 0"),
    (b'{"model":"tiny","messages":[' + b'{"role":"user","content":""},' * 600
     + b'{"role":"user","content":"hi"}]}', "more messages than the context holds"),
]


@pytest.mark.parametrize("body,what", COMPLETION_BODIES, ids=[w for _, w in COMPLETION_BODIES])
def test_malformed_completion_bodies_get_a_4xx(server, body, what):
    assert_openai_error(post(server, "/completions", body))


@pytest.mark.parametrize("body,what", CHAT_BODIES, ids=[w for _, w in CHAT_BODIES])
def test_malformed_chat_bodies_get_a_4xx(server, body, what):
    assert_openai_error(post(server, "/chat/completions", body))


def test_nulls_mean_unset_and_the_server_serves_on(server):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": None, "n": None, "temperature": None,
            "stop": None, "logprobs": None, "seed": None, "stream": None}
    response = httpx.post(server.base_url + "/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 16  # the completions default
    # A surrogate pair is one valid character, not a lone surrogate.
    pair = post(server, "/completions", C + b'"smile \\ud83d\\ude00"}')
    assert pair.status_code == 200, pair.text


def raw_exchange(running, head: bytes, body_parts: list[bytes]) -> bytes:
    """Send a request's head and only ``body_parts`` (never the whole declared body), then
    read what the server answers meanwhile."""
    host, port = httpx.URL(running.url).host, httpx.URL(running.url).port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


def test_an_oversized_body_is_refused_with_413_before_it_is_read_whole(server):
    # Content-Length over the limit: the answer comes with 1 KiB of the 10 MB sent.
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 10000000\r\n\r\n")
    answer = raw_exchange(server, head, [b"{" + b" " * 1023])
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"max-request-bytes" in answer and b"Content-Length says 10000000" in answer
    # No Content-Length (chunked): refused once the bytes received pass the limit, although
    # the body has not ended.
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (16384, b" " * 16384)
    answer = raw_exchange(server, head, [chunk] * 5)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"received so far" in answer
    # The official client sees a 413 in OpenAI's shape; a body at the limit is read.
    too_big = post(server, "/completions", C + b'"' + b"a" * SMALL_LIMIT + b'"}')
    assert assert_openai_error(too_big, 413)["code"] == "request_too_large"
    at_limit = C + b'"' + b"a" * (SMALL_LIMIT - len(C) - 3) + b'"}'
    assert len(at_limit) == SMALL_LIMIT
    assert "context" in assert_openai_error(post(server, "/completions", at_limit),
                                            400)["message"]
    assert httpx.get(server.url + "/health").status_code == 200


class TokenizerSpy:
    """Wraps the server's HF tokenizer: how many characters it was given, and whether any
    call ran on a thread with a running event loop."""

    def __init__(self, running) -> None:
        self.prompt_tokenizer = running.server.config.app.state.tokenizer
        self.inner = self.prompt_tokenizer.tokenizer
        self.chars = 0
        self.on_event_loop = 0

    def encode(self, text, **kwargs):
        self.chars += len(text)
        try:
            asyncio.get_running_loop()
            self.on_event_loop += 1
        except RuntimeError:
            pass
        return self.inner.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __enter__(self) -> TokenizerSpy:
        self.prompt_tokenizer.tokenizer = self
        return self

    def __exit__(self, *exc) -> None:
        self.prompt_tokenizer.tokenizer = self.inner


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenising(tiny):
    with running_server(tiny) as running, TokenizerSpy(running) as spy:
        limit = spy.prompt_tokenizer.max_chars
        # More characters than the context could hold whatever the tokens: not tokenised.
        error = assert_openai_error(httpx.post(running.base_url + "/completions", json={
            "model": "tiny", "prompt": "word " * (limit // 5 + 1)}, timeout=60), 400)
        assert "at least" in error["message"] and error["param"] == "prompt"
        assert spy.chars == 0
        # Under that bound but far over the context (a token per word): refused once the
        # pieces tokenised so far pass the context, long before the end.
        text = "word " * (limit // 5 - 1)
        error = assert_openai_error(httpx.post(running.base_url + "/completions", json={
            "model": "tiny", "prompt": text}, timeout=60), 400)
        assert "more than 512 tokens in its first" in error["message"]
        assert 0 < spy.chars < len(text) / 10
        # Chat content is bounded the same way; everything ran in worker threads.
        error = assert_openai_error(httpx.post(running.base_url + "/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": text}]}, timeout=60),
            400)
        assert error["param"] == "messages"
        ok = httpx.post(running.base_url + "/completions", json={
            "model": "tiny", "prompt": TEXTS[5], "max_tokens": 2})
        assert ok.status_code == 200
        assert spy.on_event_loop == 0


@pytest.fixture(scope="module")
def prompt_tokenizer(tiny) -> PromptTokenizer:
    return PromptTokenizer(tiny)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from([" ", "  ", "\n", "\t", "a", "word", "Ünï", "東京", "🙂", "123",
                                 "3.14", "!?", "<|im_start|>", "<|im_end|>", "<file_sep>",
                                 "\r\n", "-", "\u00a0", "\u3000"]), max_size=400))
def test_pieces_tokenise_like_the_whole_text(prompt_tokenizer, parts):
    assert prompt_tokenizer.piecewise
    text = "".join(parts)
    tok = prompt_tokenizer.tokenizer
    whole = tok.encode(text, add_special_tokens=False)
    for size in (1, 7, 64):
        assert [t for piece in prompt_tokenizer.split(text, size)
                for t in tok.encode(piece, add_special_tokens=False)] == whole


def test_start_up_refuses_a_kv_pool_that_cannot_serve(monkeypatch, capsys):
    with pytest.raises(InvalidRequestError, match="full context .512 tokens. needs 32 blocks"):
        ServerConfig(model="tiny", kv_cache_bytes=4096).check_kv_cache()
    with pytest.raises(InvalidRequestError, match="more than the .* bytes of memory"):
        ServerConfig(model="tiny", kv_cache_bytes=1 << 60).check_kv_cache()
    ServerConfig(model="tiny", kv_cache_bytes=32 * 3 * 2 * 16 * 2 * 16 * 4).check_kv_cache()
    ServerConfig(model="tiny").check_kv_cache()  # the default pool holds 8 full contexts
    # Qwen2.5-7B's 32k context needs 1.9 GB of bf16 K/V: more than the default 1 GiB pool.
    with pytest.raises(InvalidRequestError, match="the default KV pool holds 1170 KV blocks"):
        ServerConfig(model="qwen2.5-7b", device="cpu").check_kv_cache()

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the KV pool was checked")

    monkeypatch.setattr(server_app, "load_model", no_load)
    assert main(["serve", "--model", "tiny", "--device", "cpu", "--port", "0",
                 "--kv-cache-bytes", "4096"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kv_cache_bytes=4096 holds 0 KV blocks" in err


# -- fuzz ------------------------------------------------------------------------------------

VALID_BODIES = {
    "/completions": {"model": "tiny", "prompt": "Hello there", "max_tokens": 3,
                     "temperature": 0.7, "top_k": 5, "n": 2, "stop": ["x"], "seed": 1,
                     "logprobs": 2, "repetition_penalty": 1.1, "logit_bias": {"5": 1.0}},
    "/chat/completions": {"model": "tiny", "max_tokens": 3, "max_completion_tokens": 3,
                          "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "logprobs": True, "top_logprobs": 2, "min_p": 0.1, "stream": True},
}
LENGTHS = {"max_tokens", "max_completion_tokens", "n", "best_of"}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@st.composite
def mutated_body(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(VALID_BODIES)))
    body = json.loads(json.dumps(VALID_BODIES[path]))
    how = draw(st.sampled_from(["replace", "delete", "add", "bytes", "generated"]))
    if how == "replace":
        key = draw(st.sampled_from(sorted(body)))
        value = draw(json_values)
        # A valid but long answer (max_tokens=400, n=50) costs time and tests nothing here;
        # integers no request could use stay as drawn.
        if key in LENGTHS and isinstance(value, int) and 8 < value < 10**6:
            value = 8
        body[key] = value
    elif how == "delete":
        del body[draw(st.sampled_from(sorted(body)))]
    elif how == "add":
        body[draw(st.text(max_size=12))] = draw(json_values)
    elif how == "generated":
        return path, json.dumps(draw(json_values)).encode()
    raw = bytearray(json.dumps(body).encode())
    if how == "bytes":
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(raw) - 1))
            op = draw(st.sampled_from(["flip", "insert", "delete"]))
            if op == "flip":
                raw[at] = draw(st.integers(0, 255))
            elif op == "insert":
                raw[at:at] = bytes([draw(st.integers(0, 255))])
            else:
                del raw[at]
    return path, bytes(raw)


class HealthWatch:
    """Polls /health from a thread; the longest answer time seen."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.longest = 0.0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.longest = max(self.longest, time.perf_counter() - start)
                self.failures += not ok
                self._stop.wait(0.05)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_fuzzed_bodies_get_2xx_or_openai_4xx_and_health_stays_fast(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client, \
            HealthWatch(server.url) as health:

        @settings(max_examples=60, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow])
        @given(mutated_body())
        def check(case: tuple[str, bytes]) -> None:
            path, raw = case
            response = client.post(path, content=raw, headers={"content-type":
                                                               "application/json"})
            if response.status_code < 300:
                return
            assert_openai_error(response)

        check()
    assert health.failures == 0 and health.longest < 1.0, health.longest
    ok = httpx.post(server.base_url + "/completions", json={"model": "tiny", "prompt": "hi",
                                                            "max_tokens": 2})
    assert ok.status_code == 200


# -- load ------------------------------------------------------------------------------------

async def _stream_times(client: httpx.AsyncClient, i: int, times: list[list[float]]) -> None:
    """Stream completions one after another until cancelled, each one's token arrival times
    a list of its own in ``times`` (a stream that finishes is followed by the next, so the
    streams last as long as the test needs whatever the machine's speed)."""
    body = {"model": "tiny", "prompt": f"Stream number {i} says", "max_tokens": 320,
            "temperature": 0, "ignore_eos": True, "stream": True}
    while True:
        arrivals: list[float] = []
        times.append(arrivals)
        async with client.stream("POST", "/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())


def _worst_ratio(times: list[list[list[float]]], start: float, end: float) -> float:
    """Over the streams: the longest gap between two tokens of one completion that overlaps
    [start, end], over that stream's own median gap (all gaps of the run)."""
    ratios = []
    for stream in times:
        gaps = [(a, b) for t in stream for a, b in zip(t, t[1:], strict=False)]
        median = statistics.median(b - a for a, b in gaps)
        during = [b - a for a, b in gaps if b >= start and a <= end]
        ratios.append(max(during, default=median) / median)
    return max(ratios)


def test_the_largest_body_leaves_16_streams_streaming():
    """16 streams run in a server process; the client posts the largest body the server
    allows (a prompt filling ``--max-request-bytes``) several times, alternating with a small
    body as a control. Each post gets its 400, no stream fails, and every stream goes on
    producing tokens after the last post. What the posts cost the streams in time is printed,
    not asserted: a shared 2-core machine pauses every process now and then (one run's worst
    gap over the median gap ranged 1.3-28.7 across posts), so a bound on it fails by chance.
    That the big body is refused before any tokenising, the only work that could stall the
    streams, is asserted by ``test_a_prompt_too_long_for_the_context_is_refused_before_tokenising``."""
    limit = server_app.DEFAULT_MAX_REQUEST_BYTES
    head = b'{"model":"tiny","max_tokens":4,"prompt":"'
    big = head + b"word " * ((limit - len(head) - 2) // 5)
    big += b" " * (limit - len(big) - 2) + b'"}'
    assert len(big) == limit
    small = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 0}).encode()

    def tokens_of(stream: list[list[float]]) -> int:
        return sum(map(len, stream))

    async def run(url: str) -> tuple[dict[str, list[float]], list[str]]:
        times: list[list[list[float]]] = [[] for _ in range(16)]
        ratios: dict[str, list[float]] = {"big": [], "small": []}
        refusals = []
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            streams = [asyncio.create_task(_stream_times(client, i, times[i]))
                       for i in range(16)]
            while not all(tokens_of(t) > 20 for t in times):
                await asyncio.sleep(0.05)
            windows = []
            for trial in range(14):
                kind, content = ("big", big) if trial % 2 == 0 else ("small", small)
                start = time.perf_counter()
                response = await client.post("/completions", content=content,
                                             headers={"content-type": "application/json"})
                windows.append((kind, start, time.perf_counter()))
                assert response.status_code == 400, response.text[:200]
                if kind == "big":
                    refusals.append(response.json()["error"]["message"])
            # Every stream streams on after the last post (a stream task only ends by an
            # error: its completions follow one another).
            after = [tokens_of(t) for t in times]
            while not all(tokens_of(t) >= n + 10 for t, n in zip(times, after, strict=True)):
                assert not any(s.done() for s in streams), [s.result() for s in streams if s.done()]
                await asyncio.sleep(0.05)
            for s in streams:
                s.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        for kind, start, end in windows:
            ratios[kind].append(_worst_ratio(times, start, end))
        return ratios, refusals

    # A pool of 512 blocks holds the 16 streams whole: no preemption pauses them.
    with ServerProcess("tiny", "--device", "cpu", "--kv-cache-bytes", str(512 * 12288)) as proc:
        ratios, refusals = asyncio.run(run(proc.base_url))
    print("worst gap / median gap during each post:", {k: [round(r, 2) for r in v]
                                                       for k, v in ratios.items()})
    # Refused by the bound on characters, before any tokenising (the message says "at least").
    assert len(refusals) == 7 and all("at least" in m for m in refusals), refusals[:1]
