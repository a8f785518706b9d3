"""The server's fault cases over the composed presets (issue 79, item 3): int4 weights on the
compiled forward, speculation, the prefix cache, tensor parallel over two processes. A client
that hangs up mid-stream gives back every KV block its request held, a draft's slots included;
a tensor-parallel rank killed mid-stream ends the stream with an error naming the rank, turns
/health to 503 and never hangs. ``make soak`` runs the same presets for minutes (RSS, open files
and blocks flat); these are the cases that must hold on every ``make test``."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
from server_helpers import running_server, wait_for

from miniinfer.runner.compiled import CompileOptions

ABORTED = 'vllm:request_success_total{finished_reason="abort"}'
BLOCKS_IN_USE = "miniinfer:kv_blocks_in_use"
# A prompt that repeats itself, so that prompt lookup drafts from the first decode step on.
REPEATING = "one two three four five six seven eight " * 6
STREAM = {"model": "tiny", "prompt": REPEATING, "max_tokens": 300, "temperature": 0,
          "ignore_eos": True, "stream": True}
# Few compiled buckets and no autotuning: the fault is what is checked, not the kernels.
FAST_COMPILE = {"compile_options": CompileOptions(token_buckets=(4, 16, 64), max_autotune=False),
                "warm_up": False}
PRESETS = {
    "quantized": {"engine_settings": FAST_COMPILE},  # int4 weights, compiled forward
    "speculative": {},
    "prefix-cache": {},
    "tensor-parallel": {"kv_cache_bytes": 1 << 22},
}


def _drafting(running) -> bool:
    return running.engine.stats.drafted > 0


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_cancelled_stream_frees_every_block_and_the_server_serves_on(tiny, preset):
    with running_server(tiny, engine=preset, **PRESETS[preset]) as running:
        engine = running.engine
        with httpx.stream("POST", running.base_url + "/completions", json=STREAM,
                          timeout=120) as response:
            assert response.status_code == 200
            chunks = (line for line in response.iter_lines() if line.startswith("data: {"))
            next(chunks)
            if preset == "speculative":
                # Hang up while drafts are in flight: a step verifies draft slots.
                assert any(_drafting(running) for _ in chunks), "no draft was proposed"
                assert engine.stats.accepted > 0
            held = running.metrics()[BLOCKS_IN_USE]
            assert held > 0
        # The connection is closed a few tokens in: the request is aborted and every block
        # it held (drafts included) goes back to the pool.
        assert wait_for(lambda: running.metrics().get(ABORTED, 0.0) == 1, 60)
        assert wait_for(lambda: running.metrics()[BLOCKS_IN_USE] == 0, 60)
        manager = engine.kv_cache.block_manager
        assert manager.num_free_blocks == manager.num_blocks and not manager.block_tables
        assert not engine.scheduler.running and not engine.scheduler.waiting
        # The server serves on: the same prompt, whole, greedy, as the offline engine answers.
        response = httpx.post(running.base_url + "/completions",
                              json={**STREAM, "stream": False, "max_tokens": 8}, timeout=120)
        assert response.status_code == 200, response.text[:300]
        assert response.json()["usage"]["completion_tokens"] == 8
        assert wait_for(lambda: running.metrics()[BLOCKS_IN_USE] == 0, 60)


def test_a_rank_killed_mid_stream_ends_the_stream_naming_it_and_health_turns_503(tiny):
    with running_server(tiny, engine="tensor-parallel", kv_cache_bytes=1 << 22,
                        exit_after_failure_s=600) as running:
        (pid,) = running.engine.runner.forward.pids
        with httpx.stream("POST", running.base_url + "/completions", json=STREAM,
                          timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(pid, signal.SIGKILL)
            # The stream ends (a read would time out after 60 s rather than hang for good).
            rest = [line for line in lines if line.startswith("data: ")]
        errors = [json.loads(line.removeprefix("data: "))["error"] for line in rest
                  if line.startswith("data: {") and '"error"' in line]
        assert errors, f"the stream ended without an error: {rest[-3:]}"
        assert f"rank 1 (pid {pid}) died" in errors[-1]["message"]
        assert "data: [DONE]" not in rest[:-1]
        health = httpx.get(running.url + "/health", timeout=30)
        assert health.status_code == 503 and f"rank 1 (pid {pid})" in health.text
        assert running.metrics()["miniinfer:engine_healthy"] == 0
        assert not running.engine.scheduler.running, "the dead engine still holds the request"
