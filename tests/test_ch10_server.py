"""Chapter 10: the OpenAI-compatible server, driven by the official ``openai`` client.

One server on the tiny model runs in a thread for the whole module (output equality is all
these tests need, and tiny answers in milliseconds); the backpressure test starts a second one
with a queue of one, and the shutdown test a real child process, because SIGTERM goes to a
process."""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pandas as pd
import pytest
from conftest import TEXTS
from server_helpers import RunningServer, running_server, wait_for

from miniinfer import InvalidRequestError, SamplingParams, make_engine
from miniinfer.bench.serving import WorkloadConfig, make_workload, serve_continuous
from miniinfer.bench.serving.http import serve_http
from miniinfer.cli import main
from miniinfer.engines import continuous
from miniinfer.server import ServerProcess
from miniinfer.server.engine_loop import EngineLoop, RequestHandle

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny) -> Iterator[RunningServer]:
    with running_server(tiny) as running:
        yield running


@pytest.fixture(scope="module")
def offline(tiny):
    """Greedy text of the offline engine, as ``generate`` prints it."""
    engine = make_engine("continuous", tiny)

    def generate(prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[str, list[int]]:
        ids = engine.generate([prompt_ids], SamplingParams(max_new_tokens=max_tokens)).token_ids[0]
        return tiny.tokenizer.decode(ids, skip_special_tokens=True), ids

    return generate


def finish_reason(ids: list[int], tiny) -> str:
    return "stop" if ids[-1] == tiny.eos_token_id else "length"


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list()] == ["tiny"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.content == b""  # vLLM's: 200, no body


def test_greedy_completions_equal_offline_generate(server, tiny, offline):
    client = server.client()
    for text in TEXTS[:4]:
        prompt_ids = tiny.tokenizer.encode(text)
        expected, ids = offline(prompt_ids)
        out = client.completions.create(model="tiny", prompt=text, max_tokens=MAX_TOKENS,
                                        temperature=0)
        assert out.choices[0].text == expected
        assert out.choices[0].finish_reason == finish_reason(ids, tiny)
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids),
                                                                          len(ids))
        assert out.usage.total_tokens == len(prompt_ids) + len(ids)


def test_streamed_deltas_join_to_the_whole_text(server, tiny):
    client = server.client()
    for text in TEXTS[:3]:
        whole = client.completions.create(model="tiny", prompt=text, max_tokens=20,
                                          temperature=0)
        chunks = list(client.completions.create(
            model="tiny", prompt=text, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    # The chat stream opens with the role and ends with the finish reason, as OpenAI's does.
    messages = [{"role": "user", "content": TEXTS[0]}]
    chat = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                               temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length")
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                           temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chat) == \
        whole.choices[0].message.content


def test_chat_completions_equal_generate_chat(server, capsys):
    question = "Name three colours."
    assert main(["generate", "--model", "tiny", "--engine", "continuous", "--device", "cpu",
                 "--chat", "--prompt", question, "--max-new-tokens", str(MAX_TOKENS),
                 "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["text"]
    out = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS,
        temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected


def test_stop_string_ends_the_answer_and_is_left_out(server, tiny, offline):
    prompt = tiny.tokenizer.encode(TEXTS[2])
    full, _ = offline(prompt, 24)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop and stop.strip(), f"the greedy text is too short to cut: {full!r}"
    expected = full[:full.find(stop)]
    client = server.client()
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                    stop=[stop])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_seeded_sampling_repeats(server):
    client = server.client()
    args = dict(model="tiny", prompt=TEXTS[0], max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    assert client.completions.create(**args).choices[0].text == \
        client.completions.create(**args).choices[0].text


def test_32_concurrent_clients_each_get_their_own_answer(server, tiny, offline):
    # Different prompts and lengths; half streamed: a lost or swapped answer shows.
    long_ids = tiny.tokenizer.encode(" ".join(TEXTS))
    jobs = [(long_ids[i: i + 5 + i % 7], 4 + i % 9, i % 2 == 0) for i in range(32)]
    expected = [offline(prompt, n) for prompt, n, _ in jobs]
    client = server.client()

    def ask(job):
        prompt, n, stream = job
        if stream:
            chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                               temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, jobs))
    assert answers == [text for text, _ in expected]


def test_http_benchmark_client_gets_the_in_process_tokens(server, tiny):
    workload = make_workload(tiny, WorkloadConfig(num_requests=6, prompt_len=(4, 24),
                                                  output_len=(2, 8), seed=3))
    over_http = serve_http(server.base_url, "tiny", workload)
    in_process = serve_continuous(make_engine("continuous", tiny), workload)
    assert [r.output_ids for r in over_http.requests] == \
        [r.output_ids for r in in_process.requests]
    for r, w in zip(over_http.requests, workload, strict=True):
        t = r.timeline
        assert len(t.token_times) == w.max_new_tokens
        assert t.arrival <= t.first_scheduled <= t.first_token <= t.finish


def test_at_most_max_concurrency_requests_are_in_flight(server, tiny):
    """Chapter 15's clients: each sends its next request when its last one is answered."""
    workload = make_workload(tiny, WorkloadConfig(num_requests=6, prompt_len=(4, 8),
                                                  output_len=(4, 4), seed=5))
    run = serve_http(server.base_url, "tiny", workload, max_concurrency=2)
    spans = sorted((r.timeline.arrival, r.timeline.finish) for r in run.requests)
    for start, _ in spans:  # at each send, at most one other request is unfinished
        assert sum(1 for s, f in spans if s < start < f) <= 1
    assert spans[2][0] >= min(f for _, f in spans[:2]), "the third waited for a client"
    assert all(len(r.output_ids) == 4 for r in run.requests)


ABORTED = 'vllm:request_success_total{finished_reason="abort"}'
BLOCKS_IN_USE = "miniinfer:kv_blocks_in_use"


def test_disconnect_mid_stream_aborts_and_frees_the_blocks(server, tiny):
    before = server.metrics().get(ABORTED, 0.0)
    body = {"model": "tiny", "prompt": TEXTS[0], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metrics()[BLOCKS_IN_USE] > 0
    # The connection is closed after 1 of 400 tokens.
    assert wait_for(lambda: server.metrics().get(ABORTED, 0.0) == before + 1)
    metrics = server.metrics()
    assert metrics[BLOCKS_IN_USE] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0
    assert metrics["vllm:num_requests_running"] == 0


def test_a_non_streamed_client_that_hangs_up_is_aborted(tiny):
    # Nothing is written to a non-streamed client until the end; the watcher must notice it.
    with running_server(tiny) as own:
        engine = own.server.engine_loop.engine
        gate, step = threading.Event(), engine.step
        engine.step = lambda: gate.wait() and step()  # the answer cannot finish before we go
        body = {"model": "tiny", "prompt": TEXTS[0], "max_tokens": 50, "temperature": 0,
                "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(own.base_url + "/completions", json=body, timeout=0.5)
        gate.set()
        assert wait_for(lambda: own.metrics().get(ABORTED, 0.0) == 1)
        assert wait_for(lambda: own.metrics()[BLOCKS_IN_USE] == 0)


def test_metrics_count_requests_and_tokens(server):
    before = server.metrics()
    out = server.client().completions.create(model="tiny", prompt=TEXTS[1], max_tokens=5,
                                             temperature=0, extra_body={"ignore_eos": True})
    after = server.metrics()
    length = 'vllm:request_success_total{finished_reason="length"}'
    assert after[length] == before.get(length, 0) + 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] \
        == out.usage.completion_tokens == 5
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == \
        out.usage.prompt_tokens
    assert after["vllm:time_to_first_token_seconds_count"] == \
        before["vllm:time_to_first_token_seconds_count"] + 1
    # Four gaps between five tokens.
    assert after["vllm:inter_token_latency_seconds_count"] == \
        before["vllm:inter_token_latency_seconds_count"] + 4
    # continuous has no prefix cache: every prompt token is looked up, none is found.
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] \
        == out.usage.prompt_tokens
    assert after["vllm:prefix_cache_hits_total"] == 0


ERROR_CASES = [  # (body or raw bytes, status, words the message must hold, param)
    (b"{not json", 400, "not valid JSON", None),
    (b"[1, 2]", 400, "JSON object", None),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist", "model"),
    ({"model": "", "prompt": "hi"}, 400, "at least 1 character", "model"),
    ({"prompt": "hi"}, 400, "model is required", "model"),
    ({"model": "tiny"}, 400, "prompt is required", "prompt"),
    ({"model": "tiny", "prompt": "hi", "n": 0}, 400, "greater than or equal to 1", "n"),
    ({"model": "tiny", "prompt": "hi", "n": 3, "best_of": 2}, 400, "at least n", "best_of"),
    ({"model": "tiny", "prompt": "hi", "best_of": 2, "stream": True}, 400, "cannot be streamed",
     "best_of"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 21}, 400, "less than or equal to 20",
     "logprobs"),
    ({"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo with logprobs",
     "echo"),
    ({"model": "tiny", "prompt": "hi", "frequency_penalty": 2.5}, 400, "less than or equal",
     "frequency_penalty"),
    ({"model": "tiny", "prompt": "hi", "repetition_penalty": 0}, 400, "greater than 0",
     "repetition_penalty"),
    ({"model": "tiny", "prompt": "hi", "response_format": {"type": "json_object"}}, 400,
     "no structured output", "response_format"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"x": 1}}, 400, "token ids", "logit_bias"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "[0, 49152)",
     "logit_bias"),
    ({"model": "tiny", "prompt": "hi", "stop_token_ids": [49152]}, 400, "[0, 49152)",
     "stop_token_ids"),
    ({"model": "tiny", "prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens",
     "min_tokens"),
    ({"model": "tiny", "prompt": "hi", "suffix": "x"}, 400, "suffix", "suffix"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "8"}, 400, "valid integer", "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 8.5}, 400, "valid integer", "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "stream": 1}, 400, "valid boolean", "stream"),
    ({"model": "tiny", "prompt": "hi", "stop": [""]}, 400, "at least 1 character", "stop.0"),
    ({"model": "tiny", "prompt": ""}, 400, "at least 1 character", "prompt"),
    ({"model": "tiny", "prompt": ["a", 1]}, 400, "valid string", "prompt.1"),
    ({"model": "tiny", "prompt": [1, 10**9]}, 400, "outside", "prompt"),
    ({"model": "tiny", "prompt": "word " * 600}, 400, "context", "prompt"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 100000}, 400, "context", "prompt"),
    ({"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream=true", "stream_options"),
]


@pytest.mark.parametrize("body,status,words,param", ERROR_CASES)
def test_errors_in_openai_shape(server, body, status, words, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.base_url + "/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"] and error["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_an_empty_model_name_names_no_model(server, path):
    # Where the model may be left out, an empty name is still no model of this server's (the
    # schema fuzzer found /tokenize answering 200 to it).
    body = {"model": "", "prompt": "hi"} if path == "/tokenize" else {"model": "", "tokens": [1]}
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found"
    assert httpx.post(server.url + path, json={k: v for k, v in body.items() if k != "model"}
                      ).status_code == 200  # left out: the served model


@pytest.mark.parametrize("body,words,param", [
    ({"model": "tiny", "messages": []}, "at least 1 item", "messages"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, "'user'",
     "messages.0.role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "'text'", "messages.0.content.0.type"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{}]},
     "tools", "tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "logprobs=true", "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x " * 600}]}, "context",
     "messages"),
])
def test_chat_errors(server, body, words, param):
    response = httpx.post(server.base_url + "/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param


def test_the_official_client_raises_its_own_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="no structured output"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                "content": "hi"}],
                                       response_format={"type": "json_object"})


def test_full_waiting_queue_answers_429(tiny):
    with running_server(tiny, max_waiting=1) as small:
        # Hold the engine before its next step, so the first request stays in the queue.
        engine_loop = small.server.engine_loop
        engine = engine_loop.engine
        gate, step = threading.Event(), engine.step
        engine.step = lambda: gate.wait() and step()
        client = small.client()
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.completions.create, model="tiny", prompt="hi",
                                max_tokens=2)
            assert wait_for(lambda: engine_loop.num_waiting == 1)
            with pytest.raises(openai.RateLimitError, match="1 requests are waiting"):
                client.completions.create(model="tiny", prompt="hi", max_tokens=2)
            gate.set()
            assert first.result().usage.completion_tokens >= 1  # the queued one is served


def test_an_exception_in_one_request_fails_it_alone(server, tiny, offline, monkeypatch):
    real_sample_batch = continuous.sample_batch

    def sample_failing_for_seed_666(logits, requests, eos_token_id):
        if any(r.params.seed == 666 for r in requests):
            raise RuntimeError("planted fault")
        return real_sample_batch(logits, requests, eos_token_id)

    monkeypatch.setattr(continuous, "sample_batch", sample_failing_for_seed_666)
    client = server.client()
    prompt = tiny.tokenizer.encode(TEXTS[5])
    expected, _ = offline(prompt, 40)
    failed = 'vllm:request_success_total{finished_reason="error"}'
    errors_before = server.metrics().get(failed, 0)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                       temperature=0, stream=True)
    first = next(stream).choices[0].text  # the healthy request runs
    with pytest.raises(openai.InternalServerError, match="planted fault"):
        client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=4,
                                  temperature=1.0, seed=666)
    assert first + "".join(c.choices[0].text for c in stream) == expected
    assert server.metrics()[failed] == errors_before + 1
    # and the loop serves on
    assert client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=3,
                                     temperature=0).choices[0].finish_reason in ("stop", "length")


def _handle(request_id: int) -> RequestHandle:
    return RequestHandle(request_id, [1, 2], SamplingParams(max_new_tokens=1), (),
                         event_loop=None)


class ArrivalsOnAClock:
    """The loop's command queue and clock, scripted: each command arrives at a given time, and
    a ``get`` with a timeout advances the clock to the arrival or by the whole timeout, as a
    real queue would, so the arrival window's policy is tested without real waiting (a paused
    machine cannot make it fail)."""

    def __init__(self, arrivals: list[tuple[float, object]]) -> None:
        self.arrivals, self.now, self.timeouts = list(arrivals), 0.0, []

    def perf_counter(self) -> float:
        return self.now

    def get(self, timeout: float | None = None):
        self.timeouts.append(timeout)
        at, command = self.arrivals[0]
        if timeout is not None and at > self.now + timeout:
            self.now += timeout
            raise queue.Empty
        self.now = max(self.now, at)
        return self.arrivals.pop(0)[1]


def _taken(monkeypatch, window: float, arrivals: list[tuple[float, object]]):
    from miniinfer.server import engine_loop

    loop = EngineLoop(None, None, max_waiting=1000, arrival_window_s=window)
    script = ArrivalsOnAClock(arrivals + [(math.inf, None)])
    loop._commands = script
    monkeypatch.setattr(engine_loop, "time", script)
    taken = loop._wait_for_arrivals()
    return [c.request_id if isinstance(c, RequestHandle) else c for c in taken], script


def test_an_idle_engine_takes_a_burst_in_one_go(monkeypatch):
    # Six requests a tenth of a window apart: all taken before the first step, then one
    # window without arrivals ends the wait.
    taken, clock = _taken(monkeypatch, 0.05, [(i * 0.005, _handle(i)) for i in range(6)])
    assert taken == list(range(6))
    assert clock.now == pytest.approx(0.025 + 0.05)


def test_a_lone_request_waits_one_window_and_no_window_waits_nothing(monkeypatch):
    taken, clock = _taken(monkeypatch, 0.05, [(0.0, _handle(0))])
    assert taken == [0] and clock.timeouts == [None, 0.05] and clock.now == 0.05
    # No window: the first command alone, the others left queued for the next step.
    taken, clock = _taken(monkeypatch, 0.0, [(0.0, _handle(i)) for i in range(3)])
    assert taken == [0] and clock.timeouts == [None] and len(clock.arrivals) == 3
    # An abort wakes the loop at once, whatever the window.
    taken, clock = _taken(monkeypatch, 0.05, [(0.0, 7), (0.01, _handle(1))])
    assert taken == [7] and clock.timeouts == [None] and clock.now == 0.0


def test_a_steady_stream_is_cut_at_ten_windows(monkeypatch):
    # A request every quarter window, for ever: the wait ends at ten windows, the requests
    # that came by then taken, the rest left for the next step.
    window = 0.02
    taken, clock = _taken(monkeypatch, window, [(i * window / 4, _handle(i)) for i in range(100)])
    assert taken == list(range(41)) and clock.now == pytest.approx(10 * window)
    assert all(t is None or t <= window for t in clock.timeouts)


def test_serve_refuses_a_static_engine(capsys):
    assert main(["serve", "--model", "tiny", "--engine", "paged-attention"]) == 2
    assert "add_request" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny", "--arrival-window-ms", "-1"]) == 2
    assert "arrival_window_ms must be in 0-1000, got -1.0" in capsys.readouterr().err


def test_sigterm_aborts_in_flight_requests_and_exits_0():
    with ServerProcess("tiny", "--device", "cpu") as proc:
        client = openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=480,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(stream)
        started = time.monotonic()
        assert proc.stop() == 0
        assert time.monotonic() - started < 10  # it did not wait for the 480 tokens
        with pytest.raises(openai.APIError, match="shutting down"):
            list(stream)


def test_workload_rate_is_kept_over_http(server, tiny):
    workload = make_workload(tiny, WorkloadConfig(num_requests=4, request_rate=20.0,
                                                  prompt_len=(4, 8), output_len=(2, 3), seed=1))
    run = serve_http(server.base_url, "tiny", workload)
    sent = [r.timeline.arrival - run.start for r in run.requests]
    assert all(math.isclose(s, w.arrival_s, abs_tol=0.05) for s, w in zip(sent, workload,
                                                                           strict=True))


def test_cli_bench_serving_over_http_writes_chapter_08_tables(server, tmp_path):
    out = tmp_path / "http.csv"
    assert main(["bench-serving", "--model", "tiny", "--device", "cpu", "--base-url",
                 server.base_url, "--num-requests", "4", "--prompt-len", "4,16",
                 "--output-len", "2,4", "--no-warmup", "--chapter", "10", "--repeats", "2",
                 "--out", str(out)]) == 0
    runs = pd.read_csv(out)
    requests = pd.read_csv(tmp_path / "http-requests.csv")
    assert runs.system.tolist() == ["http"] * 2 and runs.repeat.tolist() == [0, 1]
    assert (runs.num_requests == 4).all() and len(requests) == 8
    assert sorted(requests.groupby("repeat").request.apply(list).tolist()) == [[0, 1, 2, 3]] * 2
    assert requests.output_len.between(2, 4).all() and (requests.ttft_ms > 0).all()
    # a server that serves another model is refused before anything is sent
    with pytest.raises(InvalidRequestError, match="serves tiny, not smollm2-135m"):
        serve_http(server.base_url, "smollm2-135m", [])
