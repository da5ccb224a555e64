"""A raw 2026-07-28 client for tests: per-request `_meta`, the routing headers, nothing hidden."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from service.client import sse_messages

MODERN = "2026-07-28"
EXT = "io.modelcontextprotocol/tasks"
DECLARING = {"elicitation": {"form": {}}, "extensions": {EXT: {}}}


class V2026Client:
    def __init__(self, http: httpx.AsyncClient, url: str, *, token: str | None = None,
                 capabilities: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.http = http
        self.url = url
        self.token = token
        self.capabilities = DECLARING if capabilities is None else capabilities
        self._ids = itertools.count(1)

    def body(self, method: str, params: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
        full_meta = {
            "io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": self.capabilities,
            **meta,
        }
        return {
            "jsonrpc": "2.0",
            "id": next(self._ids),
            "method": method,
            "params": {**(params or {}), "_meta": full_meta},
        }

    def headers(self, method: str, name: str | None = None, **extra: str) -> dict[str, str]:
        h = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
             "MCP-Protocol-Version": MODERN, "Mcp-Method": method}  # fmt: skip
        if name is not None:
            h["Mcp-Name"] = name
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        h.update(extra)
        return h

    async def post(self, method: str, params: dict[str, Any] | None = None, *, name: str | None = None,
                   headers: dict[str, str] | None = None, body: Any = None) -> httpx.Response:  # fmt: skip
        if name is None:
            name = (params or {}).get("taskId") if method.startswith("tasks/") else (params or {}).get("name")
        h = headers if headers is not None else self.headers(method, name)
        return await self.http.post(self.url, content=orjson.dumps(body if body is not None else self.body(method, params)),
                                    headers=h)  # fmt: skip

    async def result(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        r = await self.post(method, params)
        assert r.status_code == 200, r.text
        message = r.json()
        assert "result" in message, message
        result: dict[str, Any] = message["result"]
        return result

    async def error(self, method: str, params: dict[str, Any] | None = None, *, status: int = 200,
                    **kwargs: Any) -> dict[str, Any]:  # fmt: skip
        r = await self.post(method, params, **kwargs)
        assert r.status_code == status, (r.status_code, r.text)
        message = r.json()
        assert "error" in message, message
        error: dict[str, Any] = message["error"]
        return error

    async def listen(self, task_ids: list[str]) -> AsyncIterator[dict[str, Any]]:
        body = self.body("subscriptions/listen", {"notifications": {"taskIds": task_ids}})
        async with self.http.stream("POST", self.url, content=orjson.dumps(body),
                                    headers=self.headers("subscriptions/listen")) as r:  # fmt: skip
            assert r.status_code == 200, await r.aread()
            async for msg in sse_messages(r):
                yield msg
