"""The HTTP server's own limits (issue 14, finding 1), and the one place uvicorn's Config is built.

uvicorn with the httptools parser has a keep-alive timeout, but no header read timeout (a client
that connects and sends nothing, or a header a byte at a time, holds its socket forever), no header
size limit (llhttp buffers a header line of any length) and no cap on open connections, and its
``limit_concurrency`` counts idle connections as requests. ``LimitedHttpProtocol`` adds those four
around uvicorn's own protocol, reading only what it needs of it; ``server_config`` is used by
``mcp-tasks serve`` and by the tests' servers alike, so what is tested is what runs.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
import weakref
from collections.abc import Callable
from itertools import chain
from typing import Any, ClassVar, Final

import httptools
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.server import ServerState

from service.config import Settings
from service.mcp.http import DIRECT, send_json
from service.observability import metrics

log = logging.getLogger("service.http")

# Paths no request cap refuses: the liveness probe must not fail because the service is busy.
UNCAPPED_PATHS = frozenset({b"/healthz"})
BUSY_HEADERS: Final = {"Retry-After": "1"}
_REFUSED_CONNECTIONS = metrics.http_refusals.labels("connections")
_REFUSED_REQUESTS = metrics.http_refusals.labels("requests")
_REFUSED_HEADER_TIMEOUT = metrics.http_refusals.labels("header_timeout")
_REFUSED_HEADERS_TOO_LARGE = metrics.http_refusals.labels("headers_too_large")


def _warn_now_and_then(what: str, last: dict[str, float] = {}) -> None:  # noqa: B006 - the shared memory is the point
    """A refusal is logged at most every 10 s per kind: a flood must not flood the logs too."""
    now = time.monotonic()
    if now - last.get(what, -1e9) >= 10:
        last[what] = now
        log.warning("refusing %s (logged at most every 10 s)", what)


async def _busy(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to a request beyond MCP_TASKS_MAX_CONCURRENT_REQUESTS."""
    await send_json(send, 503, {"error": "too many concurrent requests; retry later"}, BUSY_HEADERS)


class HeadersTooLarge(Exception):
    """The request line and headers exceed MCP_TASKS_HTTP_MAX_HEADER_BYTES."""


def _plain_response(status: str, reason: str, headers: dict[str, str] | None = None) -> bytes:
    body = reason.encode()
    lines = [f"HTTP/1.1 {status}", "content-type: text/plain; charset=utf-8", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Direct:
    """The ``mcp.direct`` extension of one connection (service/mcp/http.py): a whole answer written
    at once, as uvicorn's two ``send`` calls would write it, without their per-message work and in
    one write; and a callback when the client leaves, where ASGI needs a task reading ``receive``.
    A request is named by its ASGI ``send`` or ``receive`` (methods of its uvicorn cycle); this
    object keeps no reference to a request, so a request's objects are freed by reference counting
    (a cycle through the scope would leave every request to the garbage collector)."""

    __slots__ = ("_gone", "memo")

    def __init__(self) -> None:
        self.memo: Any = None  # the app's, for this connection's later requests
        # The request waiting to hear of a disconnect (weakly: nothing of a request is kept) and
        # how to tell it. One at a time: a connection's requests are answered one after another.
        self._gone: tuple[weakref.ref[RequestResponseCycle], Callable[[], None]] | None = None

    def respond(
        self, request: Callable[..., Any], status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> bool:
        cycle = getattr(request, "__self__", None)
        line = STATUS_LINE.get(status)
        if type(cycle) is not RequestResponseCycle or line is None:
            return False
        if cycle.response_started or cycle.flow.write_paused or cycle.access_log or cycle.scope["method"] == "HEAD":
            return False  # uvicorn's send knows what to do (wait for the transport, log, send no body)
        if cycle.disconnected:
            return True  # as uvicorn's send: nobody to write to
        parts = [line]
        for name, value in cycle.default_headers:  # the server's own (date, server): sent on every answer
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value) or name == b"connection":
                return False  # uvicorn's send refuses it, or reads it (connection: close)
            parts += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", body)
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.transport.write(b"".join(parts))
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()
        return True

    def on_gone(self, request: Callable[..., Any], callback: Callable[[], None]) -> bool:
        cycle = getattr(request, "__self__", None)
        if type(cycle) is not RequestResponseCycle:
            return False  # not one of this server's requests as it comes (a wrapped receive)
        if cycle.disconnected:
            callback()
        elif not cycle.response_complete:
            self._gone = (weakref.ref(cycle), callback)
        return True

    def lost(self) -> None:
        """The connection is gone: the request waiting to hear it, if unanswered, hears it. uvicorn
        marks only its latest request disconnected, which may be a pipelined one queued behind it."""
        gone, self._gone = self._gone, None
        if gone is not None and (cycle := gone[0]()) is not None and not cycle.response_complete:
            gone[1]()


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the four limits of the module docstring. uvicorn builds a
    protocol per connection from a class (``http=``), so ``limited_protocol`` binds the limits of one
    server's settings into a subclass."""

    header_timeout_s: ClassVar[float]
    max_header_bytes: ClassVar[int]
    max_connections: ClassVar[int]
    max_requests: ClassVar[int]

    def __init__(self, config: uvicorn.Config, server_state: ServerState, app_state: dict[str, Any], **kw: Any):
        super().__init__(config, server_state, app_state, **kw)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_deadline: float | None = None  # when the awaited headers must be in
        self._in_headers = True
        self._phase_bytes = 0  # bytes received while the current request's headers are incomplete
        self._refused = False
        self._too_large = False  # a callback found the headers too large (the parser reports it as an error)
        self._direct = _Direct()  # this connection's mcp.direct

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            # Refused before it is counted: existing connections keep their requests going.
            _warn_now_and_then(f"connections beyond MCP_TASKS_MAX_CONNECTIONS ({self.max_connections})")
            _REFUSED_CONNECTIONS.inc()
            self._refused = True
            self.transport = transport
            transport.write(_plain_response("503 Service Unavailable", "too many connections", BUSY_HEADERS))
            transport.close()
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._refused:
            return
        super().connection_lost(exc)
        self._direct.lost()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_headers:
            self._phase_bytes += len(data)
        super().data_received(data)
        if self._in_headers and self._phase_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._refuse_headers()

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers every parser error with a 400, ours raised from a callback included.
        if self._too_large:
            self._refuse_headers()
        else:
            super().send_400_response(msg)

    def _refuse_headers(self) -> None:
        self._disarm_header_timer()
        if not self.transport.is_closing():
            _REFUSED_HEADERS_TOO_LARGE.inc()
            reason = f"request headers exceed {self.max_header_bytes} bytes"
            self.transport.write(_plain_response("431 Request Header Fields Too Large", reason))
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        # The request line and headers are counted once they are all parsed, not per header in
        # a callback of ours (a Python call per header): headers that arrive over several reads
        # are bounded by data_received as they come, those of one read (at most the loop's
        # read buffer, already in memory) here.
        headers = self.headers
        if len(self.url) + 4 * len(headers) + sum(map(len, chain.from_iterable(headers))) > self.max_header_bytes:
            self._too_large = True
            raise HeadersTooLarge
        self._in_headers = False
        self._phase_bytes = 0
        self._header_deadline = None
        if len(self.tasks) >= self.max_requests and httptools.parse_url(self.url).path not in UNCAPPED_PATHS:
            _warn_now_and_then(f"requests beyond MCP_TASKS_MAX_CONCURRENT_REQUESTS ({self.max_requests})")
            _REFUSED_REQUESTS.inc()
            real, self.app = self.app, _busy
            try:
                super().on_headers_complete()
            finally:
                self.app = real
            return
        super().on_headers_complete()
        self.scope["extensions"] = {DIRECT: self._direct}  # type: ignore[dict-item]  # an extension of our own

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_headers = True  # what follows is the next request's headers (keep-alive, pipelining)
        self._phase_bytes = 0

    def _arm_header_timer(self) -> None:
        # One timer per connection at a time, not one per request: a request's headers set
        # their deadline, and a timer that fires before it (an earlier request's) is set again
        # for what is left. A keep-alive connection's requests cost no timer of their own.
        # A deadline already pending stays: the first request's runs from the connection, so
        # a client silent until just before it cannot win a second timeout with one byte.
        if self._header_deadline is None:
            self._header_deadline = self.loop.time() + self.header_timeout_s
        if self._header_timer is None:
            self._header_timer = self.loop.call_at(self._header_deadline, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        self._header_deadline = None
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        deadline = self._header_deadline
        if deadline is None:
            return  # no headers awaited now: the next request's first byte sets a timer again
        if deadline > self.loop.time():
            self._header_timer = self.loop.call_at(deadline, self._header_timeout)
            return
        if self._in_headers and not self.transport.is_closing():
            # A request begun gets its 408; a connection that sent nothing is only closed: a
            # client about to send on it could take an unasked-for 408 as its answer.
            if self._phase_bytes:
                _REFUSED_HEADER_TIMEOUT.inc()
                self.transport.write(_plain_response("408 Request Timeout", "request headers not received in time"))
            self.transport.close()


def limited_protocol(settings: Settings) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with this service's limits bound in (``http=`` of uvicorn.Config)."""

    class BoundLimitedHttpProtocol(LimitedHttpProtocol):
        header_timeout_s = settings.http_header_timeout_s
        max_header_bytes = settings.http_max_header_bytes
        max_connections = settings.max_connections
        max_requests = settings.max_concurrent_requests

    return BoundLimitedHttpProtocol


def server_config(app: Any, settings: Settings, **options: Any) -> uvicorn.Config:
    """The uvicorn Config of ``mcp-tasks serve`` (``options`` add what differs: host and port,
    logging, sockets); the tests' servers use it too."""
    return uvicorn.Config(
        app,
        http=limited_protocol(settings),
        ws="none",
        access_log=False,  # it would log query strings; /mcp writes its own request line
        # No "server: uvicorn" on every response: it tells a scanner what to try (the Date header,
        # which HTTP asks of an origin server, stays).
        server_header=False,
        timeout_keep_alive=settings.http_keepalive_timeout_s,
        # Only a trusted proxy's X-Forwarded-For may name the client (rate limits, audit rows).
        proxy_headers=bool(settings.forwarded_allow_ips),
        forwarded_allow_ips=settings.forwarded_allow_ips or None,
        **options,
    )


def raise_open_files_limit(settings: Settings) -> None:
    """Make room for MCP_TASKS_MAX_CONNECTIONS sockets plus the database pool: a process out of
    file descriptors fails every tenant's requests (and its database connections) at once."""
    needed = settings.max_connections + settings.db_pool_size + settings.runner_concurrency + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "the open-files limit (%d) is below MCP_TASKS_MAX_CONNECTIONS plus the database pool (%d): "
            "lower MCP_TASKS_MAX_CONNECTIONS or raise the limit (ulimit -n)",
            soft,
            needed,
        )
