"""Chapter 10: health that tells the truth (issue 68, item 1).

Once the engine can no longer serve (a tensor-parallel rank died, the engine loop's thread died)
``GET /health`` answers 503 with the reason in OpenAI's error shape, every request gets a 503
saying the same, ``miniinfer:engine_healthy`` drops to 0, and the server exits with status 3
(``EXIT_ENGINE_DEAD``) so that a supervisor starts a fresh one. Every test waits on the state it
asserts (the health status, the thread's end, the process's exit), never on a sleep."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from server_helpers import running_server, wait_for

from miniinfer.runner.tensor_parallel import RankFailure
from miniinfer.server import ServerProcess
from miniinfer.server.app import EXIT_ENGINE_DEAD

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


def health(running_url: str) -> httpx.Response:
    return httpx.get(running_url + "/health", timeout=30)


def unhealthy(url: str) -> bool:
    try:
        return health(url).status_code == 503
    except httpx.TransportError:  # not listening any more
        return False


def assert_dead(response: httpx.Response, *words: str) -> str:
    assert response.status_code == 503, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "engine_dead" and error["type"] == "server_error"
    assert error["message"].startswith("the engine can no longer serve: ")
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


def test_a_healthy_server_says_so(tiny):
    with running_server(tiny) as running:
        response = health(running.url)
        assert response.status_code == 200 and response.content == b""
        assert running.metrics()["miniinfer:engine_healthy"] == 1
        assert running.server.exit_status == 0


def test_a_dead_rank_makes_health_503_and_every_request_503(tiny, monkeypatch):
    """A step that finds a rank dead (RankFailure: the group is shut down for good) is not
    one request's fault: nothing is retried, the engine is declared dead."""
    with running_server(tiny, exit_after_failure_s=600) as running:
        reason = "tensor-parallel rank 1 (pid 4242) died (killed by signal SIGKILL)"

        def step():
            raise RankFailure(reason)

        monkeypatch.setattr(running.engine, "step", step)
        first = httpx.post(running.base_url + "/completions", json=BODY, timeout=60)
        assert_dead(first, reason)
        assert_dead(health(running.url), reason)
        assert running.metrics()["miniinfer:engine_healthy"] == 0
        # Later requests, streamed or not, get the same answer at once; health stays 503.
        assert_dead(httpx.post(running.base_url + "/completions", json=BODY, timeout=60),
                    reason)
        assert_dead(httpx.post(running.base_url + "/completions",
                               json={**BODY, "stream": True}, timeout=60), reason)
        assert_dead(health(running.url), reason)
        assert running.server.exit_status == EXIT_ENGINE_DEAD
        assert not running.server.should_exit  # not before exit_after_failure_s


def test_a_dead_engine_thread_makes_health_503_and_the_server_exit(tiny, monkeypatch):
    """An error the loop cannot blame on a request ends its thread: the server says why on
    /health, answers the request in flight, then stops with EXIT_ENGINE_DEAD."""
    with running_server(tiny, exit_after_failure_s=0.5) as running:
        def add_request(*args, **kwargs):
            raise ZeroDivisionError("a bug in the engine")

        monkeypatch.setattr(running.engine, "add_request", add_request)
        response = httpx.post(running.base_url + "/completions", json=BODY, timeout=60)
        assert_dead(response, "ZeroDivisionError: a bug in the engine")
        assert running.server.exit_status == EXIT_ENGINE_DEAD
        assert wait_for(lambda: running.server.should_exit, 30), "the server did not stop"


def test_a_killed_rank_of_an_idle_tp2_server_is_noticed_without_a_request(tiny):
    """The user's case, for real: a TP=2 server, its worker killed while no request runs. The
    idle engine probes its workers, so /health turns 503 naming the rank, with no request sent
    to find out."""
    with running_server(tiny, tensor_parallel=2, exit_after_failure_s=600,
                        kv_cache_bytes=1 << 22) as running:
        assert httpx.post(running.base_url + "/completions", json=BODY,
                          timeout=60).status_code == 200
        (pid,) = running.engine.runner.forward.pids
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: unhealthy(running.url), 30), "health stayed 200"
        assert_dead(health(running.url), f"rank 1 (pid {pid}) died (killed by signal SIGKILL)")
        assert_dead(httpx.post(running.base_url + "/completions", json=BODY, timeout=60),
                    f"rank 1 (pid {pid})")
        assert running.metrics()["miniinfer:engine_healthy"] == 0


def _workers_of(pid: int) -> list[int]:
    """The tensor-parallel workers the server process spawned (not multiprocessing's
    resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children
            if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_serve_exits_with_status_3_after_a_rank_dies():
    """``python -m miniinfer serve --tensor-parallel 2``: a worker killed, /health 503 with
    the reason for exit_after_failure_s (5 s), then the process exits with status 3."""
    with ServerProcess("tiny", "--tensor-parallel", "2", "--kv-cache-bytes",
                       str(1 << 22)) as server:
        (worker,) = _workers_of(server.process.pid)
        os.kill(worker, signal.SIGKILL)
        assert wait_for(lambda: unhealthy(server.url), 30), "health stayed 200"
        assert_dead(health(server.url), f"rank 1 (pid {worker}) died")
        assert wait_for(lambda: server.process.poll() is not None, 60), "the server ran on"
        assert server.process.returncode == EXIT_ENGINE_DEAD
        log = server.log.read_text()
        assert "the engine can no longer serve" in log and "exiting with status 3" in log
