"""Chapter 10: a 413 every client reads (issue 68, item 2).

A body over ``--max-request-bytes`` is answered with a 413 before it has all arrived; the
server then closes with a linger (``miniinfer.server.linger``): the write side first, what
the client still sends read and thrown away, the socket closed when the client has finished.
Without it, the close under a client still uploading is a reset, and the reset discards the
413 the client had not read yet. Each test asserts the status the client read."""

from __future__ import annotations

import select
import socket

import httpx
import pytest
from server_helpers import running_server, wait_for

from miniinfer.server import linger

LIMIT = 64 * 1024
CHUNK = 64 * 1024
HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n")


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(tiny, max_request_bytes=LIMIT) as running:
        yield running


def connect(running) -> socket.socket:
    host, port = running.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def answered(sock: socket.socket) -> bool:
    """Whether the server's answer has arrived (the socket has bytes to read)."""
    return bool(select.select([sock], [], [], 0)[0])


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; a reset raises ConnectionResetError."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:100]
    return int(answer.split(b" ", 2)[1])


def upload_past_the_answer(sock: socket.socket, chunk: bytes, after: int) -> int:
    """Send ``chunk`` until the server's answer arrives (the event), then ``after`` more:
    a client still sending when the server has answered. Returns the bytes sent."""
    sent = 0
    while not answered(sock):
        sock.sendall(chunk)
        sent += len(chunk)
        assert sent < 64 * LIMIT, "no answer although the body is far past the limit"
    for _ in range(after):
        sock.sendall(chunk)
        sent += len(chunk)
    return sent


def test_a_slow_chunked_upload_reads_its_413(server):
    """No Content-Length: the 413 comes once the bytes received pass the limit; the client
    sends 32 more chunks after it has arrived, ends the body, and reads a 413."""
    for _ in range(3):
        with connect(server) as sock:
            sock.sendall(HEAD + b"transfer-encoding: chunked\r\n\r\n")
            upload_past_the_answer(sock, b"%x\r\n%s\r\n" % (CHUNK, b" " * CHUNK), after=32)
            sock.sendall(b"0\r\n\r\n")
            answer = read_to_end(sock)  # a reset would raise here
        assert status_of(answer) == 413
        assert b"received so far" in answer and b"request_too_large" in answer


def test_a_slow_upload_with_a_content_length_reads_its_413(server):
    """Content-Length over the limit: the 413 comes before the body is read; the client
    sends all of its 4 MiB after it, piece by piece, and reads a 413."""
    size = 4 << 20
    with connect(server) as sock:
        sock.sendall(HEAD + b"content-length: %d\r\n\r\n" % size)
        sent = upload_past_the_answer(sock, b" " * CHUNK, after=0)
        while sent < size:
            sock.sendall(b" " * CHUNK)
            sent += CHUNK
        answer = read_to_end(sock)
    assert status_of(answer) == 413
    assert b"Content-Length says %d" % size in answer


def test_one_20_mb_body_reads_its_413(server):
    """The user's case: one 20 MB body, sent as fast as loopback goes, by httpx (which
    writes the whole body before it reads); five times, as the reset was intermittent."""
    body = b"x" * (20 << 20)
    for _ in range(5):
        response = httpx.post(server.base_url + "/completions", content=body, timeout=60,
                              headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
    # Chunked (a generator: no Content-Length), the same.
    chunks = (b" " * CHUNK for _ in range(320))
    response = httpx.post(server.base_url + "/completions", content=chunks, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_linger_is_bounded(server, monkeypatch):
    """A client that stops sending mid-body after its 413 but keeps the connection open is
    closed after LINGER_IDLE_S; one that sends more than LINGER_MAX_BYTES, once past it."""
    monkeypatch.setattr(linger, "LINGER_IDLE_S", 1.0)  # long enough for a starved client thread
    with connect(server) as sock:
        sock.sendall(HEAD + b"content-length: %d\r\n\r\n" % (1 << 30))
        upload_past_the_answer(sock, b" " * CHUNK, after=0)
        assert status_of(read_to_end(sock)) == 413  # the close came, without our FIN
    monkeypatch.setattr(linger, "LINGER_IDLE_S", 30.0)
    monkeypatch.setattr(linger, "LINGER_MAX_BYTES", 1 << 20)
    with connect(server) as sock:
        # No wait for the answer here: loopback buffers hold more than the 1 MiB bound, so the
        # server may give up before this client has seen its 413.
        sock.sendall(HEAD + b"content-length: %d\r\n\r\n" % (1 << 30))
        with pytest.raises(OSError):  # the server gives up: a reset under our upload
            for _ in range(1024):  # 64 MiB: far past the 1 MiB bound, short of the default 256
                sock.sendall(b" " * CHUNK)
    assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200)
