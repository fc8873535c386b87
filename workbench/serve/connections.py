"""The server's edge: how many connections it keeps open, and how long a client may take to send
a request.

uvicorn keeps every accepted socket until its client closes it, and has no timeout for a request
that arrives slowly: 20,000 sockets that each sent half a header held the server at its
file-descriptor limit, and new clients were refused until they closed.  :class:`GuardedH11`,
uvicorn's h11 protocol with two rules added, bounds both:

* **connections:** at most ``max_connections`` open at once; one more is closed on arrival, so
  its descriptor is freed at once (the client sees the connection reset and may retry);
* **request time:** a request's headers and body must arrive within ``request_timeout_s`` of the
  connection opening (or of the previous response ending, on a kept-alive connection), else the
  connection is closed.  Once the request is in, the response takes as long as it takes (a long
  stream is not cut).

Idle kept-alive connections close after uvicorn's ``timeout_keep_alive`` (``keep_alive_s``), and
h11 refuses headers over 16 KiB (uvicorn's ``h11_max_incomplete_event_size``).  The counts are on
``/metrics`` (``workbench_http_connections_refused_total``, ``..._timed_out_total``).
"""

from __future__ import annotations

import logging
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("workbench.serve")

DEFAULT_MAX_CONNECTIONS = 2048
HEADER_BYTES = 16 * 1024                   # h11's limit on a request's head


def default_max_connections() -> int:
    """2,048, or half the process's file-descriptor limit when that is lower (the other half is
    for the engine's files, the offload tier and the listening socket)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(16, min(DEFAULT_MAX_CONNECTIONS, soft // 2))


def guarded_protocol(max_connections: int, request_timeout_s: float, counters: dict):
    """The protocol class for uvicorn's ``http=`` with these limits; ``counters`` (a dict) gets
    ``refused`` and ``timed_out`` counts."""

    class Protocol(GuardedH11):
        pass

    Protocol.max_connections, Protocol.request_timeout_s, Protocol.counters = (max_connections, request_timeout_s,
                                                                               counters)
    return Protocol


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and a request timeout (see the module)."""

    max_connections = DEFAULT_MAX_CONNECTIONS
    request_timeout_s = 30.0
    counters: dict = {}

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._request_timer = None
        if len(self.server_state.connections) >= self.max_connections:
            self.counters["refused"] = self.counters.get("refused", 0) + 1
            if self.counters["refused"] in (1, 100, 10_000) or self.counters["refused"] % 100_000 == 0:
                log.warning("connection refused: %d open, the limit is %d (--max-connections); %d refused so far",
                            len(self.server_state.connections), self.max_connections, self.counters["refused"])
            transport.abort()                  # the descriptor goes now, not after a close handshake
            self.transport = None
            return
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self.transport is None:             # refused in connection_made: uvicorn never saw it
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()                     # the whole request is in: the response takes its time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport is not None and not self.transport.is_closing():
            self._arm()                        # the next request on this connection: the same allowance

    # -- the request timer
    def _arm(self) -> None:
        self._disarm()
        self._request_timer = self.loop.call_later(self.request_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        timer = getattr(self, "_request_timer", None)
        if timer is not None:
            timer.cancel()
            self._request_timer = None

    def _timed_out(self) -> None:
        self._request_timer = None
        if self.transport is None or self.transport.is_closing():
            return
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            return
        self.counters["timed_out"] = self.counters.get("timed_out", 0) + 1
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True     # the app, waiting on the body, sees the client gone
        self.transport.close()
