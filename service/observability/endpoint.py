"""The metrics port: ``/metrics``, ``/healthz`` and ``/readyz`` only, apart from ``/mcp``.

``mcp-tasks serve`` opens it when ``MCP_TASKS_METRICS_PORT`` is set (so ``/metrics`` need not be
reachable where ``/mcp`` is), ``mcp-tasks worker`` too (its only HTTP). A few lines of asyncio
rather than a second uvicorn server: it answers three GETs and must not take over signal handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import orjson

from service.observability import metrics

log = logging.getLogger(__name__)

# (HTTP status, JSON body) of the readiness check.
Readiness = Callable[[], Awaitable[tuple[int, dict[str, object]]]]
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request", 503: "Service Unavailable"}


class MetricsEndpoint:
    """A tiny HTTP/1.1 server on its own port; one request per connection."""

    def __init__(self, host: str, port: int, readiness: Readiness) -> None:
        self.host, self.port, self.readiness = host, port, readiness
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=16_384)
        log.info("metrics, /healthz and /readyz on %s:%s", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                request_line = await reader.readline()
                accept = ""
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.strip().lower() == "accept":  # OpenMetrics (exemplars) when asked for
                        accept = value.strip()
                status, ctype, body = await self._answer(request_line, accept)
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, request_line: bytes, accept: str = "") -> tuple[int, str, bytes]:
        parts = request_line.decode("latin-1").split()
        if len(parts) != 3:
            return 400, "text/plain", b"bad request\n"
        verb, target, _version = parts
        path = target.split("?", 1)[0]
        if path not in ("/metrics", "/healthz", "/readyz"):
            return 404, "text/plain", b"not found: this port serves /metrics, /healthz and /readyz\n"
        if verb != "GET":
            return 405, "text/plain", b"GET only\n"
        if path == "/metrics":
            exposed, content_type = metrics.exposition(accept)
            return 200, content_type, exposed
        if path == "/healthz":
            return 200, "application/json", b'{"status":"ok"}'
        status, body = await self.readiness()
        return status, "application/json", orjson.dumps(body)
