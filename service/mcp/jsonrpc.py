"""JSON-RPC 2.0 framing: codes, the error exception, and message builders."""

from __future__ import annotations

from typing import Any, Final

import orjson

PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
METHOD_NOT_FOUND: Final = -32601
INVALID_PARAMS: Final = -32602
INTERNAL_ERROR: Final = -32603
# Server-defined range (-32000..-32099); docs/decisions.md lists them.
CAPACITY_EXCEEDED: Final = -32000
SERVICE_UNAVAILABLE: Final = -32001
RATE_LIMITED: Final = -32029

RequestId = str | int


class RpcFailure(Exception):
    """A JSON-RPC error to send back; ``http_status`` for errors answered outside a 200."""

    def __init__(
        self,
        code: int,
        message: str,
        data: Any = None,
        *,
        http_status: int = 200,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.http_status = http_status
        self.headers = headers or {}

    def error_object(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            err["data"] = self.data
        return err


def result_message(request_id: RequestId, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def error_message(request_id: RequestId | None, error: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def notification(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params}


def request(request_id: RequestId, method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}


def dumps(message: Any) -> bytes:
    return orjson.dumps(message)


def check_client_data(what: str, value: Any, limit: int) -> None:
    """Issue 14 §4: what the client declares about itself is kept (capabilities, clientInfo), so
    its size is bounded; over the limit is a -32602 naming the limit."""
    if value is None:
        return
    try:
        size = len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):  # pragma: no cover - parsed JSON always encodes
        size = limit + 1
    if size > limit:
        raise RpcFailure(
            INVALID_PARAMS, f"{what} is {size} bytes encoded, more than this server keeps ({limit})", {"limit": limit}
        )


def valid_id(value: Any) -> bool:
    """H-GEN-4: a string or an integer (not a bool, not null)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
