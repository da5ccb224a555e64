"""The 2026-07-28 wire toward an upstream that speaks it: stateless requests with ``_meta`` (protocol
version, client capabilities), the routing headers (``Mcp-Method``, ``Mcp-Name``), answers as JSON
or as an SSE stream of notifications ending with the response.

The official SDK (1.x) speaks up to 2025-11-25 and has no client for this wire or for the Tasks
extension (``io.modelcontextprotocol/tasks``), so this is the small part of a client that calling
an upstream's tools as its tasks needs, over httpx (the SDK's own HTTP client, and the same
connection pool as its sessions). An upstream that speaks both is listed on the SDK's 2025-11-25
session; one that speaks only this wire is listed and followed here too (``discover``,
``list_tools``; docs/decisions.md, "Upstreams with the Tasks extension").
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import httpx
import httpx_sse
import orjson

from service.observability import tracing

PROTOCOL: Final = "2026-07-28"
EXTENSION: Final = "io.modelcontextprotocol/tasks"
META_VERSION: Final = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES: Final = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT: Final = "io.modelcontextprotocol/clientInfo"
# What we declare: the extension, and the questions we relay to our own client (form elicitation,
# sampling, roots). A question our client cannot answer fails our call (there is no error answer).
CAPABILITIES: Final[dict[str, Any]] = {
    "elicitation": {"form": {}},
    "sampling": {},
    "roots": {},
    "extensions": {EXTENSION: {}},
}
CLIENT_INFO: Final = {"name": "mcp-task-service", "version": "1"}
ENVELOPE_BYTES: Final = 64 * 1024  # what an answer may hold beyond the result limit
MAX_PAGES: Final = 100  # of one tools/list

Notified = Callable[[dict[str, Any]], Awaitable[None]]


class ModernError(Exception):
    """The upstream answered with a JSON-RPC error."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"error {code}: {message}")
        self.code = code
        self.message = message


class BadAnswer(Exception):
    """Not a JSON-RPC answer to our request (or one larger than we keep)."""


class SilentUpstream(Exception):
    """Nothing arrived for the request within the time it had."""


class Modern:
    """Requests of the 2026-07-28 wire to one upstream. ``headers``: called per request for ours
    (credentials); each request adds the caller's forward headers."""

    def __init__(
        self, url: str, client: httpx.AsyncClient, headers: Callable[[], Awaitable[dict[str, str]]], max_bytes: int,
        on_unauthorized: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        self.url = url
        self.client = client
        self.headers = headers
        self.on_unauthorized = on_unauthorized  # our token refused: fetch a new one next time
        self.max_bytes = max_bytes + ENVELOPE_BYTES
        self._ids = itertools.count(1)

    async def request(
        self, method: str, params: dict[str, Any], *, name: str | None = None, forward: dict[str, str] | None = None,
        idle_s: float, deadline: float, meta: dict[str, Any] | None = None, on_notification: Notified | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The result of one request; ``idle_s`` bounds each wait for the next message, ``deadline``
        (time.monotonic()) all of it. A ModernError for an error answer; BadAnswer, SilentUpstream
        or httpx's errors for the rest."""
        with tracing.client_span(f"{method} {name}" if name else method, {"mcp.method.name": method,
                                 "mcp.protocol.version": PROTOCOL}):  # fmt: skip
            return await self._request(method, params, name=name, forward=forward, idle_s=idle_s, deadline=deadline,
                                       meta=meta, on_notification=on_notification)  # fmt: skip

    async def _request(
        self, method: str, params: dict[str, Any], *, name: str | None, forward: dict[str, str] | None,
        idle_s: float, deadline: float, meta: dict[str, Any] | None, on_notification: Notified | None,
    ) -> dict[str, Any]:  # fmt: skip
        request_id = next(self._ids)
        full_meta = {META_VERSION: PROTOCOL, META_CAPABILITIES: CAPABILITIES, META_CLIENT: CLIENT_INFO, **(meta or {})}
        tracing.inject(full_meta)  # the span's context in _meta (the MCP conventions)
        body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": {**params, "_meta": full_meta}}
        headers = {
            **(forward or {}), **await self.headers(), "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream", "MCP-Protocol-Version": PROTOCOL, "Mcp-Method": method,
        }  # fmt: skip
        if name is not None:
            headers["Mcp-Name"] = name
        tracing.inject(headers)
        limits = httpx.Timeout(min(idle_s, _left(deadline)), connect=min(10.0, _left(deadline)))
        heard = [time.monotonic()]  # when the upstream last sent a message for this request
        exchange = asyncio.ensure_future(self._exchange(body, headers, limits, request_id, heard, on_notification))
        try:  # bounded by the deadline and idle_s whatever the upstream streams (comments, empty events)
            while not exchange.done():
                wait_s = min(_left(deadline), heard[0] + idle_s - time.monotonic())
                if wait_s <= 0 or deadline <= time.monotonic():
                    raise SilentUpstream()
                await asyncio.wait({exchange}, timeout=wait_s)
            return exchange.result()
        except httpx.TimeoutException:
            raise SilentUpstream() from None
        finally:
            if not exchange.done():
                exchange.cancel()
                await asyncio.wait({exchange})

    async def _exchange(
        self, body: dict[str, Any], headers: dict[str, str], limits: httpx.Timeout, request_id: int,
        heard: list[float], on_notification: Notified | None,
    ) -> dict[str, Any]:  # fmt: skip
        async with self.client.stream("POST", self.url, content=orjson.dumps(body), headers=headers,
                                      timeout=limits) as r:  # fmt: skip
            if r.status_code == 401:
                self.on_unauthorized()
                raise BadAnswer("HTTP 401: it refused our credentials")
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                return await self._streamed(r, request_id, heard, on_notification)
            return _answer(await self._body(r), request_id, r.status_code)

    async def _body(self, r: httpx.Response) -> bytes:
        chunks, size = [], 0
        async for chunk in r.aiter_bytes():
            size += len(chunk)
            if size > self.max_bytes:
                raise BadAnswer(f"an answer above {self.max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _streamed(
        self, r: httpx.Response, request_id: int, heard: list[float], on_notification: Notified | None
    ) -> dict[str, Any]:
        """The answer on an SSE stream; ``heard`` notes when each message came (not an empty event)."""
        async for event in httpx_sse.EventSource(r).aiter_sse():
            if not event.data:
                continue
            heard[0] = time.monotonic()
            if len(event.data) > self.max_bytes:
                raise BadAnswer(f"a message above {self.max_bytes} bytes")
            message = _json(event.data.encode())
            if "method" in message and "id" not in message:
                if on_notification is not None:
                    await on_notification(message)
                continue
            return _answer(message, request_id, r.status_code)
        raise BadAnswer("the stream ended without an answer")


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _json(raw: bytes) -> dict[str, Any]:
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadAnswer("an answer that is not JSON") from None
    if not isinstance(message, dict):
        raise BadAnswer("an answer that is not a JSON-RPC message")
    return message


def _answer(raw: bytes | dict[str, Any], request_id: int, status: int) -> dict[str, Any]:
    message = raw if isinstance(raw, dict) else _json(raw) if raw else {}
    error = message.get("error")
    if isinstance(error, dict) and isinstance(error.get("code"), int):
        raise ModernError(error["code"], str(error.get("message", ""))[:500])
    result = message.get("result")
    if message.get("id") != request_id or not isinstance(result, dict):
        raise BadAnswer(f"HTTP {status} without an answer to our request" if status >= 300 else "no answer to it")
    return result


async def discovered(modern: Modern, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """The upstream's ``server/discover`` result; what went wrong raised (ModernError, BadAnswer,
    SilentUpstream, httpx's errors), BadAnswer too when it does not list 2026-07-28."""
    found = await modern.request("server/discover", {}, idle_s=timeout_s, deadline=time.monotonic() + timeout_s)
    versions = found.get("supportedVersions")
    if not (isinstance(versions, list) and PROTOCOL in versions):
        raise BadAnswer(f"a server/discover answer that does not list {PROTOCOL}")
    return found


async def discover(modern: Modern, *, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The upstream's ``server/discover`` result when it speaks 2026-07-28 (None otherwise)."""
    try:
        return await discovered(modern, timeout_s=timeout_s)
    except (ModernError, BadAnswer, SilentUpstream, httpx.HTTPError):
        return None


def offers_tasks(found: dict[str, Any] | None) -> bool:
    """Whether a ``server/discover`` result offers the Tasks extension."""
    capabilities = found.get("capabilities") if found is not None else None
    extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    return isinstance(extensions, dict) and EXTENSION in extensions


async def speaks_tasks_extension(modern: Modern, *, timeout_s: float = 10.0) -> bool:
    """Whether the upstream answers 2026-07-28's server/discover and offers the Tasks extension."""
    return offers_tasks(await discover(modern, timeout_s=timeout_s))


async def list_tools(modern: Modern, *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The upstream's tools, every page of ``tools/list`` on this wire (at most MAX_PAGES)."""
    tools: list[dict[str, Any]] = []
    cursor: str | None = None
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_PAGES):
        page = await modern.request("tools/list", {"cursor": cursor} if cursor else {}, idle_s=timeout_s,
                                    deadline=deadline)  # fmt: skip
        listed = page.get("tools")
        if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
            raise BadAnswer("a tools/list answer without a list of tools")
        tools.extend(listed)
        cursor = page.get("nextCursor") if isinstance(page.get("nextCursor"), str) else None
        if not cursor:
            return tools
    raise BadAnswer(f"a tools/list of more than {MAX_PAGES} pages")
