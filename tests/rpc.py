"""A raw JSON-RPC-over-Streamable-HTTP session for tests: every message visible, nothing hidden."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from service.client import sse_messages

__all__ = ["ACCEPT_BOTH", "RpcSession", "sse_messages"]

ACCEPT_BOTH = "application/json, text/event-stream"


class RpcSession:
    def __init__(self, http: httpx.AsyncClient, url: str, *, token: str | None = None) -> None:
        self.http = http
        self.url = url
        self.token = token
        self.session_id: str | None = None
        self.version = "2025-11-25"
        self._ids = itertools.count(1)

    def headers(self, **extra: str) -> dict[str, str]:
        h = {"Accept": ACCEPT_BOTH, "Content-Type": "application/json"}
        if self.session_id:
            h["Mcp-Session-Id"] = self.session_id
            h["MCP-Protocol-Version"] = self.version
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        h.update(extra)
        return h

    async def initialize(
        self, version: str = "2025-11-25", capabilities: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body = {
            "jsonrpc": "2.0",
            "id": next(self._ids),
            "method": "initialize",
            "params": {
                "protocolVersion": version,
                "capabilities": {"elicitation": {}} if capabilities is None else capabilities,
                "clientInfo": {"name": "tests", "version": "1"},
            },
        }
        r = await self.http.post(self.url, json=body, headers=self.headers())
        assert r.status_code == 200, r.text
        self.session_id = r.headers["mcp-session-id"]
        result: dict[str, Any] = r.json()["result"]
        self.version = result["protocolVersion"]
        n = await self.http.post(
            self.url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=self.headers()
        )
        assert n.status_code == 202
        return result

    def message(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": next(self._ids), "method": method}
        if params is not None:
            msg["params"] = params
        return msg

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """The final JSON-RPC response (result or error) of one request."""
        final: dict[str, Any] = {}
        async for msg in self.stream(method, params):
            if "id" in msg and "method" not in msg:
                final = msg
        return final

    async def result(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        response = await self.send(method, params)
        assert "result" in response, response
        result: dict[str, Any] = response["result"]
        return result

    async def error(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        response = await self.send(method, params)
        assert "error" in response, response
        error: dict[str, Any] = response["error"]
        return error

    async def stream(self, method: str, params: dict[str, Any] | None = None) -> AsyncIterator[dict[str, Any]]:
        async with self.http.stream("POST", self.url, json=self.message(method, params), headers=self.headers()) as r:
            self.last_status = r.status_code
            self.last_content_type = r.headers.get("content-type", "")
            if self.last_content_type.startswith("text/event-stream"):
                async for msg in sse_messages(r):
                    yield msg
            else:
                yield orjson.loads(await r.aread())

    async def reply(self, rpc_id: Any, result: dict[str, Any]) -> httpx.Response:
        return await self.http.post(
            self.url, json={"jsonrpc": "2.0", "id": rpc_id, "result": result}, headers=self.headers()
        )

    async def call_tool_as_task(
        self, name: str, arguments: dict[str, Any], task: dict[str, Any] | None = None, **params: Any
    ) -> dict[str, Any]:
        return await self.result(
            "tools/call", {"name": name, "arguments": arguments, "task": task if task is not None else {}, **params}
        )
