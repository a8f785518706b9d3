"""A server on a loaded model in a thread of the test process, and what tests read from it;
shared by the chapter 10 test modules."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from miniinfer.server import Server, ServerConfig, build_server


@dataclass
class RunningServer:
    server: Server
    base_url: str

    def client(self) -> openai.OpenAI:
        # No retries: a 429 or a 500 must reach the test as it is.
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60)

    @property
    def url(self) -> str:
        return self.base_url.removesuffix("/v1")

    @property
    def engine(self):
        return self.server.engine_loop.engine

    def metrics(self) -> dict[str, float]:
        """Every sample by its name and labels other than model_name, parsed by
        prometheus_client: ``vllm:request_success_total{finished_reason="abort"}``."""
        return scrape(self.url)


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            name = sample.name + "".join(f'{{{k}="{v}"}}' for k, v in sorted(labels.items()))
            samples[name] = sample.value
    return samples


@contextmanager
def running_server(lm, **options) -> Iterator[RunningServer]:
    server, sock = build_server(ServerConfig(model=lm.name, port=0, **options), lm=lm)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started, 60), "the server did not start"
    host, port = sock.getsockname()[:2]
    try:
        yield RunningServer(server, f"http://{host}:{port}/v1")
    finally:
        server.should_exit = True
        thread.join(30)
        server.engine_loop.engine.close()  # as serve does: a tensor-parallel rank ends too


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False
