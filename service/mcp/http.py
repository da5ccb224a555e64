"""HTTP-level answers of the MCP endpoint: refusals outside JSON-RPC, and JSON bodies."""

from __future__ import annotations

from typing import Any

from starlette.types import Send

from service.mcp import jsonrpc


class HttpError(Exception):
    """An HTTP-level refusal, answered with a JSON-RPC error body without id (H-POST-3)."""

    def __init__(self, status: int, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


async def send_json(send: Send, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
    payload = b"" if body is None else jsonrpc.dumps(body)
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if body is not None:
        raw.append((b"content-type", b"application/json"))
    raw.append((b"content-length", str(len(payload)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
