"""One lean Streamable HTTP MCP session for the load generator: JSON and SSE answers, failures as kinds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import orjson

PROTOCOL_VERSION: Final = "2025-11-25"
REQUEST_TIMEOUT_S: Final = 30.0
# After the matching SSE event the server should end the stream at once; reading on briefly keeps the
# keep-alive connection reusable, but a server that holds the stream open must not stall the client.
SSE_DRAIN_S: Final = 0.5
_OK_STATUSES: Final = frozenset({200, 202})


class RequestFailed(Exception):
    """A request that produced no usable answer; ``kind`` is a short, bounded label (``rpc_-32602``)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class McpSession:
    """One simulated client's MCP session: its own ``initialize``, its own headers, sequential requests."""

    __slots__ = ("_headers", "_http", "_next_id", "_timeout_s", "_url", "session_id")

    def __init__(
        self, http: httpx.AsyncClient, url: str, *, token: str | None, timeout_s: float = REQUEST_TIMEOUT_S
    ) -> None:
        self._http = http
        self._url = url
        self._timeout_s = timeout_s
        self._next_id = 0
        self.session_id: str | None = None
        # Built once and reused: per-request header dicts are measurable churn at tens of thousands of ops/s.
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": PROTOCOL_VERSION,
        }
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    async def initialize(self) -> None:
        """Open the session (``initialize`` + ``notifications/initialized``); raises RequestFailed."""
        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "mcp-tasks-bench", "version": "1"},
        }
        result, session_id = await self._exchange("initialize", params)
        if session_id:
            self.session_id = session_id
            self._headers["Mcp-Session-Id"] = session_id
        version = result.get("protocolVersion")
        if isinstance(version, str) and version:
            self._headers["MCP-Protocol-Version"] = version
        await self.notify("notifications/initialized")

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its ``result``; raises RequestFailed on any kind of failure."""
        result, _ = await self._exchange(method, params)
        return result

    async def notify(self, method: str) -> None:
        body = orjson.dumps({"jsonrpc": "2.0", "method": method})
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._http.post(self._url, content=body, headers=self._headers)
        except (TimeoutError, httpx.TimeoutException):
            raise RequestFailed("timeout") from None
        except httpx.HTTPError as exc:
            raise RequestFailed(f"transport_{type(exc).__name__}") from None
        if response.status_code not in _OK_STATUSES:
            raise RequestFailed(f"http_{response.status_code}")

    async def close(self, timeout_s: float = 2.0) -> None:
        """End the session with DELETE (H-SESS-6), best effort: a server may answer 405 or be gone."""
        if self.session_id is None:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await self._http.delete(self._url, headers=self._headers)
        except (TimeoutError, httpx.HTTPError):
            pass

    async def _exchange(self, method: str, params: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        self._next_id += 1
        rpc_id = self._next_id
        body = orjson.dumps({"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": params})
        request = self._http.build_request("POST", self._url, content=body, headers=self._headers)
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._http.send(request, stream=True)
                try:
                    message = await self._answer(response, rpc_id)
                finally:
                    await response.aclose()
        except (TimeoutError, httpx.TimeoutException):
            raise RequestFailed("timeout") from None
        except httpx.HTTPError as exc:
            raise RequestFailed(f"transport_{type(exc).__name__}") from None
        except orjson.JSONDecodeError:
            raise RequestFailed("protocol_bad_json") from None
        except RequestFailed:
            raise
        except Exception as exc:
            # A load generator must keep counting, not crash, whatever a strange answer does to the client.
            raise RequestFailed(f"client_{type(exc).__name__}") from None
        error = message.get("error")
        if error is not None:
            code = error.get("code") if isinstance(error, dict) else None
            raise RequestFailed(f"rpc_{code}" if isinstance(code, int) else "rpc_malformed")
        result = message.get("result")
        if not isinstance(result, dict):
            raise RequestFailed("protocol_no_result")
        return result, response.headers.get("mcp-session-id")

    async def _answer(self, response: httpx.Response, rpc_id: int) -> dict[str, Any]:
        status = response.status_code
        if status != 200:
            # Read the (small) body so the connection stays reusable; the status alone names the failure.
            await response.aread()
            raise RequestFailed(f"http_{status}" if status not in _OK_STATUSES else "protocol_no_response")
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return await _sse_answer(response, rpc_id)
        message = orjson.loads(await response.aread())
        if not isinstance(message, dict):
            raise RequestFailed("protocol_not_object")
        return message


async def _sse_answer(response: httpx.Response, rpc_id: int) -> dict[str, Any]:
    """The JSON-RPC response with ``rpc_id`` from an SSE stream; notifications and server requests are skipped."""
    chunks = response.aiter_bytes()
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\r" in buffer:
            # sse-starlette (the SDK peers) ends lines with CRLF; a CR split across chunks is rejoined here.
            buffer = buffer.replace(b"\r\n", b"\n")
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:end], buffer[end + 2 :]
            message = _event_message(event)
            if message is not None and message.get("id") == rpc_id and ("result" in message or "error" in message):
                await _drain(chunks)
                return message
    raise RequestFailed("protocol_no_response")


def _event_message(event: bytes) -> dict[str, Any] | None:
    data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    if not data:
        return None  # a comment (keep-alive) or an event without data
    message = orjson.loads(b"\n".join(data))
    return message if isinstance(message, dict) else None


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    try:
        async with asyncio.timeout(SSE_DRAIN_S):
            async for _ in chunks:
                pass
    except TimeoutError:
        pass
