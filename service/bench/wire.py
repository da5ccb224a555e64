"""One lean Streamable HTTP MCP session for the load generator: JSON and SSE answers, failures as kinds."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

import orjson

from service.bench.http1 import Connection, Endpoint, HttpError, Response
from service.bench.sse import SseParser

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
    """One simulated client's MCP session: its own connection, ``initialize`` and headers; sequential requests."""

    __slots__ = ("_delete_head", "_headers", "_next_id", "_post_head", "_timeout_s", "connection", "session_id")

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connection = Connection(Endpoint.from_url(url, ssl_context))
        self._timeout_s = timeout_s
        self._next_id = 0
        self.session_id: str | None = None
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": PROTOCOL_VERSION,
        }
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._post_head = self._delete_head = b""
        self._build_heads()

    def _build_heads(self) -> None:
        # Built once per session (and again after initialize): per-request header encoding is measurable churn.
        endpoint = self.connection.endpoint
        self._post_head = endpoint.head("POST", self._headers)
        self._delete_head = endpoint.head("DELETE", self._headers)

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
        self._build_heads()
        await self.notify("notifications/initialized")

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its ``result``; raises RequestFailed on any kind of failure."""
        result, _ = await self._exchange(method, params)
        return result

    async def notify(self, method: str) -> None:
        body = orjson.dumps({"jsonrpc": "2.0", "method": method})
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self.connection.request(self._post_head, body)
                await response.read()
        except TimeoutError:
            raise RequestFailed("timeout") from None
        except HttpError as exc:
            raise RequestFailed(f"transport_{type(exc).__name__}") from None
        if response.status not in _OK_STATUSES:
            raise RequestFailed(f"http_{response.status}")

    async def close(self, timeout_s: float = 2.0) -> None:
        """End the session with DELETE (H-SESS-6), best effort: a server may answer 405 or be gone."""
        try:
            if self.session_id is not None:
                async with asyncio.timeout(timeout_s):
                    response = await self.connection.request(self._delete_head, b"")
                    await response.read()
        except (TimeoutError, HttpError):
            pass
        finally:
            await self.connection.close()

    async def _exchange(self, method: str, params: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        self._next_id += 1
        rpc_id = self._next_id
        body = orjson.dumps({"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": params})
        message, response = await exchange(self.connection, self._post_head, body, rpc_id, self._timeout_s, read_answer)
        return result_of(message), response.headers.get("mcp-session-id")


class Session(Protocol):
    """What the workloads need of a client's session, whichever wire it speaks."""

    async def initialize(self) -> None: ...

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]: ...

    async def close(self, timeout_s: float = 2.0) -> None: ...


Reader = Callable[[Response, int], Awaitable[dict[str, Any]]]


async def exchange(
    connection: Connection, head: bytes, body: bytes, rpc_id: int, timeout_s: float, read: Reader
) -> tuple[dict[str, Any], Response]:
    """Send one request and read its JSON-RPC message with ``read``; every failure is a RequestFailed."""
    try:
        async with asyncio.timeout(timeout_s):
            response = await connection.request(head, body)
            message = await read(response, rpc_id)
    except TimeoutError:
        raise RequestFailed("timeout") from None
    except HttpError as exc:
        raise RequestFailed(f"transport_{type(exc).__name__}") from None
    except orjson.JSONDecodeError:
        raise RequestFailed("protocol_bad_json") from None
    except RequestFailed:
        raise
    except Exception as exc:
        # A load generator must keep counting, not crash, whatever a strange answer does to the client.
        raise RequestFailed(f"client_{type(exc).__name__}") from None
    return message, response


def result_of(message: dict[str, Any]) -> dict[str, Any]:
    """The ``result`` of a JSON-RPC response; its error (or a missing result) as a RequestFailed."""
    error = message.get("error")
    if error is not None:
        code = error.get("code") if isinstance(error, dict) else None
        raise RequestFailed(f"rpc_{code}" if isinstance(code, int) else "rpc_malformed")
    result = message.get("result")
    if not isinstance(result, dict):
        raise RequestFailed("protocol_no_result")
    return result


async def read_answer(response: Response, rpc_id: int) -> dict[str, Any]:
    status = response.status
    if status != 200:
        # Read the (small) body so the connection stays reusable; the status alone names the failure.
        await response.read()
        raise RequestFailed(f"http_{status}" if status not in _OK_STATUSES else "protocol_no_response")
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return await _sse_answer(response, rpc_id)
    message = orjson.loads(await response.read())
    if not isinstance(message, dict):
        raise RequestFailed("protocol_not_object")
    return message


async def _sse_answer(response: Response, rpc_id: int) -> dict[str, Any]:
    """The JSON-RPC response with ``rpc_id`` from an SSE stream; notifications and server requests are skipped."""
    parser = SseParser()
    while piece := await response.next_chunk():
        for data in parser.feed(piece):
            message = orjson.loads(data)
            if (
                isinstance(message, dict)
                and message.get("id") == rpc_id
                and ("result" in message or "error" in message)
            ):
                await _drain(response)
                return message
    raise RequestFailed("protocol_no_response")


async def _drain(response: Response) -> None:
    """Read the stream to its end so the connection can carry the next request.

    The answer is already in hand: a stream that stays open past SSE_DRAIN_S, or breaks, costs only the
    connection (the next request opens a new one), never the request.
    """
    if response.done:
        return
    try:
        async with asyncio.timeout(SSE_DRAIN_S):
            while await response.next_chunk():
                pass
    except (TimeoutError, HttpError):
        pass
