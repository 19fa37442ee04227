"""Connection guards under the app: uvicorn's h11 protocol with a read timeout, a write-stall
timeout and a cap on open connections.

- read timeout: a client has `read_timeout` seconds from connecting (or from the first byte of
  its next request on a kept-alive connection) to send a whole request, headers and body;
  slow or half-open connections are closed, and the app sees a disconnect (an abort).
- write stall: when a client stops reading, the socket's buffers fill and asyncio pauses
  writing. A connection paused for `stall_timeout` seconds is aborted: its stream ends, its
  requests are aborted and their KV blocks freed, and nothing more is buffered for it.
- `max_connections`: a connection past it is answered 503 and closed at once.

uvicorn's own keep-alive timeout still closes idle connections between requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

_BUSY_BODY = json.dumps({"error": {"message": "too many open connections; retry later", "type": "service_unavailable",
                                   "param": None, "code": "too_many_connections"}}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\n"
         b"content-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


def guarded_protocol(read_timeout: float, stall_timeout: float, max_connections: int | None) -> type[asyncio.Protocol]:
    """An h11 protocol class for `uvicorn.Config(http=...)` with these limits."""
    limits = {"read_timeout": read_timeout, "stall_timeout": stall_timeout, "max_connections": max_connections}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), limits)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the guards; `guarded_protocol` sets the limits on a subclass."""

    read_timeout: float = 60.0
    stall_timeout: float = 60.0
    max_connections: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.max_connections is not None and len(self.connections) >= self.max_connections:
            self._refused, self.transport = True, transport
            logger.warning("refusing a connection: %d are open (--max-connections)", len(self.connections))
            transport.write(_BUSY)
            transport.close()
            return
        super().connection_made(transport)
        self._arm_read()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read()
        self._cancel_stall()
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            if self._read_timer is None:  # a request has begun: it must arrive whole in time
                self._arm_read()
        else:
            self._cancel_read()

    def on_response_complete(self) -> None:
        self._cancel_read()  # idle between requests: uvicorn's keep-alive timeout applies
        super().on_response_complete()

    def _arm_read(self) -> None:
        self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _cancel_read(self) -> None:
        _cancel(self._read_timer)
        self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            logger.info("closing the connection from %s: no whole request within %.0f s (--read-timeout)",
                        _peer(self.client), self.read_timeout)
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.stall_timeout, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_stall()

    def _cancel_stall(self) -> None:
        _cancel(self._stall_timer)
        self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        logger.warning("closing the connection from %s: it has not read its response for %.0f s "
                       "(--stream-stall-timeout)", _peer(self.client), self.stall_timeout)
        self.transport.abort()  # drop what is buffered: a client that does not read never will


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    """Cancel a timer if one is armed."""
    if timer is not None:
        timer.cancel()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
