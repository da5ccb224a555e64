"""A 2026-07-28 client for the load generator: the Tasks extension (``io.modelcontextprotocol/tasks``).

No session: every request is a stateless POST that carries the protocol version and the declared
extension in ``params._meta`` and the routing headers ``MCP-Protocol-Version``, ``Mcp-Method`` and
``Mcp-Name`` (the tool's name on ``tools/call``, the task id on ``tasks/*``). It rides the same lean
HTTP/1.1 connection as the 2025-11-25 session, one per simulated client; errors come as HTTP 4xx
with a JSON-RPC error body, and are counted by their JSON-RPC code.
"""

from __future__ import annotations

import base64
import ssl
from typing import Any, Final

import orjson

from service.bench.http1 import Connection, Endpoint, Response
from service.bench.wire import REQUEST_TIMEOUT_S, RequestFailed, exchange, read_answer, result_of

V2026_VERSION: Final = "2026-07-28"
TASKS_EXTENSION: Final = "io.modelcontextprotocol/tasks"
# Declaring requests (the extension only: the workloads ask no questions, so no elicitation).
META: Final = {
    "io.modelcontextprotocol/protocolVersion": V2026_VERSION,
    "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXTENSION: {}}},
}


def header_value(value: str) -> str:
    """A header value as sent: plain printable ASCII as it is, anything else in the ``=?base64?…?=`` form."""
    if value.isascii() and value.isprintable():
        return value
    return "=?base64?" + base64.b64encode(value.encode()).decode() + "?="


class V2026Session:
    """One simulated client on the 2026-07-28 wire: its own connection and token; sequential requests."""

    __slots__ = ("_heads", "_next_id", "_post_head", "_timeout_s", "connection")

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
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": V2026_VERSION,
        }
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._post_head = self.connection.endpoint.head("POST", headers)
        # Heads of requests whose routing headers repeat (tools/call of one tool, server/discover).
        self._heads: dict[tuple[str, str | None], bytes] = {}

    def _head(self, method: str, name: str | None) -> bytes:
        extra = f"Mcp-Method: {method}\r\n" + (f"Mcp-Name: {header_value(name)}\r\n" if name is not None else "")
        return self._post_head + extra.encode("latin-1")

    async def initialize(self) -> None:
        """``server/discover`` (there is no handshake): refuse a server that does not offer the extension."""
        result = await self.request("server/discover", {})
        extensions = (result.get("capabilities") or {}).get("extensions")
        if not isinstance(extensions, dict) or TASKS_EXTENSION not in extensions:
            raise RequestFailed("no_tasks_extension")

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its ``result``; raises RequestFailed on any kind of failure."""
        if method.startswith("tasks/"):
            name = params.get("taskId")
            head = self._head(method, name if isinstance(name, str) else None)
        else:
            tool = params.get("name") if method == "tools/call" else None
            key = (method, tool if isinstance(tool, str) else None)
            head = self._heads.get(key) or self._heads.setdefault(key, self._head(*key))
        self._next_id += 1
        rpc_id = self._next_id
        body = orjson.dumps({"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": {**params, "_meta": META}})
        message, _ = await exchange(self.connection, head, body, rpc_id, self._timeout_s, _v2026_answer)
        return result_of(message)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Nothing to end on the server (no session): close the connection."""
        await self.connection.close()


async def _v2026_answer(response: Response, rpc_id: int) -> dict[str, Any]:
    """Errors come with HTTP 400/404 and a JSON-RPC error body: count them by their code."""
    if response.status == 200:
        return await read_answer(response, rpc_id)
    body = await response.read()
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        message = None
    if isinstance(message, dict) and isinstance(message.get("error"), dict):
        return message
    raise RequestFailed(f"http_{response.status}")
