"""A small Streamable HTTP MCP client: used by ``mcp-tasks call`` (and handy in tests)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson

PROTOCOL_VERSION = "2025-11-25"
# "Unavailable, retry shortly": HTTP 503, -32001 (2025-11-25), -31001 (2026-07-28, X-ERR-2).
RETRYABLE_CODES = (503, -32001, -31001)


class McpClientError(Exception):
    """A JSON-RPC error, an HTTP refusal without one (``code`` the HTTP status), a lost connection
    (``code`` "connection") or an answer that is not MCP at all (``code`` "protocol")."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.error = error

    @property
    def retryable(self) -> bool:
        return self.error.get("code") in RETRYABLE_CODES or self.error.get("http_status") == 503


def _protocol_error(what: str) -> McpClientError:
    return McpClientError({"code": "protocol", "message": what})


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _protocol_error(f"not JSON: {body[:80].decode(errors='replace')!r}") from None


class McpClient:
    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Accept": "application/json, text/event-stream"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.url = url
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, read=None))
        self.session_id: str | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> McpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "MCP-Protocol-Version": PROTOCOL_VERSION}
        if self.session_id:
            h["Mcp-Session-Id"] = self.session_id
        return h

    async def initialize(
        self, capabilities: dict[str, Any] | None = None, *, retry_for_s: float = 0.0
    ) -> dict[str, Any]:
        """Open the session; with ``retry_for_s``, "unavailable, retry shortly" answers and lost
        connections are retried with backoff for that long (nothing exists before a session)."""
        return await _retrying(lambda: self._initialize(capabilities), retry_for_s, idempotent=True)

    async def _initialize(self, capabilities: dict[str, Any] | None) -> dict[str, Any]:
        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": capabilities or {"elicitation": {}},
            "clientInfo": {"name": "mcp-tasks-cli", "version": "1"},
        }
        async with self.http.stream(
            "POST", self.url, json=self._msg("initialize", params), headers=self._headers()
        ) as r:
            if r.status_code != 200:
                answer = _json_answer(r.status_code, await r.aread(), r.reason_phrase)
                raise McpClientError(answer.get("error") or {"code": r.status_code, "message": r.text})
            self.session_id = r.headers.get("mcp-session-id")
            result = await self._final(r)
        await self.notify("notifications/initialized", {})
        return result

    def _msg(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": next(self._ids), "method": method, "params": params}

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        await self.http.post(
            self.url, json={"jsonrpc": "2.0", "method": method, "params": params}, headers=self._headers()
        )

    async def respond(self, rpc_id: Any, result: dict[str, Any]) -> None:
        await self.http.post(self.url, json={"jsonrpc": "2.0", "id": rpc_id, "result": result}, headers=self._headers())

    async def stream(self, method: str, params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Every message the server sends for this request, the response last."""
        async with self.http.stream("POST", self.url, json=self._msg(method, params), headers=self._headers()) as r:
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                async for message in sse_messages(r):
                    yield message
            else:
                yield _json_answer(r.status_code, await r.aread(), r.reason_phrase)

    async def request(self, method: str, params: dict[str, Any], *, retry_for_s: float = 0.0) -> dict[str, Any]:
        """The request's result; with ``retry_for_s``, retried as ``V2026Client.request`` is."""
        return await _retrying(lambda: self._request_once(method, params), retry_for_s,
                               idempotent=method != "tools/call")  # fmt: skip

    async def _request_once(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        final: dict[str, Any] = {}
        async for message in self.stream(method, params):
            final = message
        if "error" in final:
            raise McpClientError(final["error"])
        result: dict[str, Any] = final.get("result", {})
        return result

    async def _final(self, r: httpx.Response) -> dict[str, Any]:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            last: dict[str, Any] = {}
            async for message in sse_messages(r):
                last = message
        else:
            last = _loads(await r.aread())
        if not isinstance(last, dict) or not isinstance(last.get("result", last.get("error")), dict):
            raise _protocol_error("no JSON-RPC result")
        if "error" in last:
            raise McpClientError(last["error"])
        result: dict[str, Any] = last["result"]
        return result


def _json_answer(status: int, body: bytes, reason: str) -> dict[str, Any]:
    """A JSON-RPC answer; an HTTP refusal without one (a proxy's 502, a plain 401) as an error."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        message = None
    if status >= 400 and not (isinstance(message, dict) and isinstance(message.get("error"), dict)):
        text = body.decode(errors="replace").strip()[:200] or reason
        return {"error": {"code": status, "message": text, "http_status": status}}
    if not isinstance(message, dict) or not isinstance(message.get("result", message.get("error")), dict):
        return {"error": {"code": "protocol", "message": f"HTTP {status} without a JSON-RPC answer"}}
    if status >= 400:
        message["error"].setdefault("code", status)
        message["error"]["http_status"] = status
    return message


async def _retrying(
    once: Callable[[], Awaitable[dict[str, Any]]], retry_for_s: float, *, idempotent: bool
) -> dict[str, Any]:
    """``once()``, again after "unavailable, retry shortly" (503, -32001) and, if ``idempotent``,
    after a lost connection, with backoff, for up to ``retry_for_s``; then the last error. A lost
    connection is McpClientError code "connection"."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_for_s
    delay = 0.25
    while True:
        try:
            return await once()
        except McpClientError as exc:
            if not exc.retryable or loop.time() + delay > deadline:
                raise
        except httpx.TransportError as exc:
            if not idempotent or loop.time() + delay > deadline:
                raise McpClientError({"code": "connection", "message": f"{type(exc).__name__}: {exc}"}) from None
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def sse_messages(r: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    data: list[str] = []
    async for line in r.aiter_lines():
        if line == "":
            if data:
                payload = "\n".join(data)
                data = []
                if payload:
                    message = _loads(payload.encode())
                    if not isinstance(message, dict):
                        raise _protocol_error("an event that is not a JSON-RPC message")
                    yield message
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))


V2026_VERSION = "2026-07-28"
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"


class V2026Client:
    """A 2026-07-28 client: no session; every request carries its ``_meta`` and routing headers."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
                   "MCP-Protocol-Version": V2026_VERSION}  # fmt: skip
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.url = url
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, read=None))
        self.capabilities: dict[str, Any] = {"elicitation": {"form": {}}, "extensions": {TASKS_EXTENSION: {}}}
        self._ids = itertools.count(1)

    async def __aenter__(self) -> V2026Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    def _body(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        meta = {"io.modelcontextprotocol/protocolVersion": V2026_VERSION,
                "io.modelcontextprotocol/clientCapabilities": self.capabilities,
                "io.modelcontextprotocol/clientInfo": {"name": "mcp-tasks-cli", "version": "1"}}  # fmt: skip
        return {"jsonrpc": "2.0", "id": next(self._ids), "method": method,
                "params": {**params, "_meta": {**params.get("_meta", {}), **meta}}}  # fmt: skip

    def _headers(self, method: str, params: dict[str, Any]) -> dict[str, str]:
        h = {"Mcp-Method": method}
        name = params.get("taskId") if method.startswith("tasks/") else params.get("name")
        if isinstance(name, str):
            h["Mcp-Name"] = name
        return h

    async def request(
        self, method: str, params: dict[str, Any], *, retry_for_s: float = 60.0,
        on_message: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One request; "unavailable, retry shortly" answers (503, -32001) are retried with backoff
        for up to ``retry_for_s``, and so are lost connections for requests that change nothing
        (everything but tools/call, which a lost answer might already have run). An answer sent as
        a stream (a tools/call with a progress token, XD-18) gives its notifications to
        ``on_message`` before the result."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + retry_for_s
        delay = 0.25
        while True:
            try:
                return await self._request_once(method, params, on_message)
            except McpClientError as exc:
                if not exc.retryable or loop.time() + delay > deadline:
                    raise
            except httpx.TransportError as exc:
                if method == "tools/call" or loop.time() + delay > deadline:
                    raise McpClientError({"code": "connection", "message": f"{type(exc).__name__}: {exc}"}) from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _request_once(
        self, method: str, params: dict[str, Any], on_message: Callable[[dict[str, Any]], None] | None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"error": {"code": "protocol", "message": "a stream that ended without an answer"}}
        async with self.http.stream("POST", self.url, content=orjson.dumps(self._body(method, params)),
                                    headers=self._headers(method, params)) as r:  # fmt: skip
            if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
                async for sent in sse_messages(r):
                    if "result" in sent or "error" in sent:
                        message = sent
                        break
                    if on_message is not None:
                        on_message(sent)
            else:
                message = _json_answer(r.status_code, await r.aread(), r.reason_phrase)
        if "error" in message:
            raise McpClientError(dict(message["error"]))
        result: dict[str, Any] = message["result"]
        return result

    async def listen(self, task_ids: list[str]) -> AsyncIterator[dict[str, Any]]:
        """The subscription's messages (ack first); McpClientError if the server refuses it."""
        params = {"notifications": {"taskIds": task_ids}}
        async with self.http.stream("POST", self.url, content=orjson.dumps(self._body("subscriptions/listen", params)),
                                    headers=self._headers("subscriptions/listen", params)) as r:  # fmt: skip
            if not r.headers.get("content-type", "").startswith("text/event-stream"):
                message = _json_answer(r.status_code, await r.aread(), r.reason_phrase)
                raise McpClientError(message.get("error") or {"code": r.status_code, "message": "refused"})
            async for message in sse_messages(r):
                yield message
