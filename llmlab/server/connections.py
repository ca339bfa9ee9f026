"""Connection limits: no socket is held open for nothing (slowloris).

A server on the open internet runs out of sockets if a client may open connections and
send nothing, or half a request, or one byte a second. uvicorn 0.55 guards against little
of that: its keep-alive timer starts only after a response (a connection that never sent a
request stays open forever), nothing limits how long a request may take to arrive (the
`--timeout-request-start` of uvicorn issue #157 never landed), and its `limit_concurrency`
answers past the limit in plain text. So `llmlab serve` runs uvicorn's own HTTP/1.1
protocol (h11) with three additions:

* idle timeout (`timeout_keep_alive`): a connection with no request on its way is closed
  after this long, from the moment it opens as well as after each response;
* read timeout (`timeout_read`): from a request's first byte, its headers and body must
  all arrive within this long, however the bytes trickle in; otherwise a 408 and the
  connection closes. Once a request is in, the clock stops: generating and streaming the
  answer may take as long as they take;
* a cap (`max_connections`): a request on a connection past the cap gets a 503 in OpenAI's
  error format, and the connection closes.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmlab.server.protocol import APIError, shutting_down

logger = logging.getLogger("llmlab.server")


@dataclass(frozen=True)
class ConnectionLimits:
    timeout_read: float = 10.0       # seconds for a whole request (headers and body) to arrive, from its first byte
    timeout_keep_alive: float = 5.0  # seconds a connection may be idle: before its first request or between two
    max_connections: int = 1024      # open connections; a request on one more gets a 503


def protocol_for(limits: ConnectionLimits):
    """The `http=` protocol factory for `uvicorn.Config`."""
    return functools.partial(LimitedH11Protocol, limits=limits)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, one instance per connection, with the limits above."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.read_deadline: asyncio.TimerHandle | None = None   # armed while a request is arriving

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.app = too_many_connections(self.limits.max_connections)   # this connection's requests
        # idle until its first byte: uvicorn's keep-alive timer (it arms it only after a response);
        # the first byte stops it (H11Protocol.data_received)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        # h11's view of the client: IDLE with bytes buffered = part of a request line or headers;
        # SEND_BODY = headers in, body arriving; DONE / MUST_CLOSE = the whole request is in
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            if self.read_deadline is None:    # from the first byte: later bytes do not extend it
                self.read_deadline = self.loop.call_later(self.limits.timeout_read, self.read_timed_out)
        else:
            self.cancel_read_deadline()

    def read_timed_out(self) -> None:
        self.read_deadline = None
        if self.transport.is_closing():
            return
        if self.request_arriving():
            # written past h11's bookkeeping: the connection closes right after
            self.transport.write(REQUEST_TIMEOUT_RESPONSE)
        self.transport.close()    # (a handler still reading the body sees a disconnect)

    def refuse_arriving_request(self) -> None:
        """Shutdown, once the grace period is over: a request still arriving gets a 503 with
        Retry-After and the connection closes. Its handler, if its headers are in, waits for
        the body and can answer nothing; left alone, uvicorn's backstop would cancel it,
        which uvicorn answers with a 500. Connections with no request arriving are left to
        uvicorn's shutdown (running requests end with the engine's own 503)."""
        if not self.transport.is_closing() and self.request_arriving():
            self.transport.write(SHUTTING_DOWN_RESPONSE)
            self.transport.close()    # (its handler sees a disconnect)

    def request_arriving(self) -> bool:
        """Part of a request is in, not all of it (h11: bytes of a request line or headers
        buffered, or the body arriving), and nothing has been answered on the connection."""
        arriving = self.conn.their_state is h11.SEND_BODY or bool(self.conn.trailing_data[0])
        answering = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        return arriving and not answering

    def cancel_read_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def connection_lost(self, exc) -> None:
        self.cancel_read_deadline()
        super().connection_lost(exc)


def raw_response(error: APIError, reason: str, headers: bytes = b"") -> bytes:
    """An error as the bytes of a whole HTTP/1.1 response that closes the connection, for a
    connection on which no handler can answer."""
    body = json.dumps(error.body()).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%sconnection: close"
            b"\r\n\r\n%s" % (error.status, reason.encode(), len(body), headers, body))


REQUEST_TIMEOUT_RESPONSE = raw_response(APIError(
    408, "the request did not arrive in time: its headers and body must arrive within the server's read "
         "timeout (--timeout-read)", code="request_timeout"), "Request Timeout")
SHUTTING_DOWN_RESPONSE = raw_response(shutting_down(), "Service Unavailable", b"retry-after: 1\r\n")


def too_many_connections(limit: int):
    """An ASGI app that answers every request with a 503 and closes the connection."""
    error = APIError(503, f"this server is at its limit of {limit} open connections (--max-connections); "
                          f"retry later", type="server_error", code="too_many_connections")
    body = json.dumps(error.body()).encode()

    async def refuse(scope, receive, send) -> None:
        logger.warning("refused a request: at the limit of %d open connections (--max-connections)", limit)
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})
    return refuse
