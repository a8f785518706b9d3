"""A lingering close: an answer sent before the request's body ended (a 413) reaches a client
that is still sending it.

A server that closes its socket while unread bytes sit in it makes the kernel send a reset
(RST) rather than an orderly end (FIN), and a reset tells the client's kernel to throw away
what it received but the client has not read yet: the 413 itself. A client writes its whole
body before it reads the answer (httpx, requests, the openai package), so one that is still
uploading when the server closes sees "connection reset" and never its 413. uvicorn closes at
once after an answer marked ``Connection: close``.

So, as nginx and Apache do (``lingering_close``), a connection closed while its request's
body is still coming is closed in two halves: the write side first (the answer, then a FIN),
then the read side once the client has stopped sending (its FIN; asyncio closes the
socket on it); meanwhile what it sends is read and
thrown away. The wait is bounded: ``LINGER_S`` in all, ``LINGER_IDLE_S`` without a byte,
``LINGER_MAX_BYTES`` discarded; past a bound the socket closes as before (a reset, if bytes
are still coming). Every other close (keep-alive timeouts, the server stopping) is
unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("miniinfer.server")

LINGER_S = 30.0  # nginx's lingering_time
LINGER_IDLE_S = 5.0  # nginx's lingering_timeout: no byte for this long, and we close
LINGER_MAX_BYTES = 256 << 20  # a client may finish a body this large after its 413


class LingeringTransport:
    """The protocol's view of its transport: ``close`` lingers while a body is still coming."""

    def __init__(self, transport: asyncio.Transport, protocol: LingeringH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self.lingering = False
        self.stopping = False
        self.discarded = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        transport = self._transport
        if self.lingering or transport.is_closing():
            return
        cycle = self._protocol.cycle
        if (cycle is None or not cycle.more_body or self.stopping
                or not transport.can_write_eof()):
            transport.close()
            return
        # The answer is in the write buffer; write_eof sends the FIN after it.
        self.lingering = True
        transport.write_eof()
        transport.resume_reading()  # uvicorn pauses reading when a body waits unread
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(LINGER_S, self.give_up, "lingered the longest")
        self._idle = loop.call_later(LINGER_IDLE_S, self.give_up, "client idle")

    def discard(self, data: bytes) -> None:
        self.discarded += len(data)
        if self.discarded > LINGER_MAX_BYTES:
            self.give_up(f"discarded more than {LINGER_MAX_BYTES} bytes")
        elif self._idle is not None:
            self._idle.cancel()
            self._idle = asyncio.get_running_loop().call_later(
                LINGER_IDLE_S, self.give_up, "client idle")

    def give_up(self, why: str) -> None:
        if not self._transport.is_closing():
            logger.info("closing a lingering connection (%s) after discarding %d bytes",
                        why, self.discarded)
        self.cancel_timers()
        self._transport.close()

    def cancel_timers(self) -> None:
        for timer in (self._deadline, self._idle):
            if timer is not None:
                timer.cancel()


class LingeringH11Protocol(H11Protocol):
    """uvicorn's h11 protocol (the one it runs without httptools), closing with a linger."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(LingeringTransport(transport, self))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if isinstance(transport, LingeringTransport) and transport.lingering:
            transport.discard(data)
            return
        super().data_received(data)

    def shutdown(self) -> None:
        """The server is stopping: close at once, lingering or not."""
        transport = self.transport
        if isinstance(transport, LingeringTransport):
            transport.stopping = True
            if transport.lingering:
                transport.give_up("the server is stopping")
                return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(self.transport, LingeringTransport):
            self.transport.cancel_timers()
        super().connection_lost(exc)
