"""JSON-RPC 2.0 framing: codes and message builders."""

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
STORAGE_QUOTA_EXCEEDED: Final = -32004
RATE_LIMITED: Final = -32029
# The 2026-07-28 wire's codes (X-ERR), each with the HTTP status §11 names.
V2026_HEADER_MISMATCH: Final = -32020
V2026_MISSING_CAPABILITY: Final = -32021
V2026_UNSUPPORTED_VERSION: Final = -32022
# Our application codes on 2026-07-28: X-ERR-2 forbids undefined codes in -32020..-32099 and
# discourages the legacy -32000..-32019, so each is its 2025-11-25 code plus 1000 (docs/decisions.md).
V2026_CAPACITY_EXCEEDED: Final = -31000
V2026_SERVICE_UNAVAILABLE: Final = -31001
V2026_STORAGE_QUOTA_EXCEEDED: Final = -31004
V2026_RATE_LIMITED: Final = -31029

RequestId = str | int


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


def valid_id(value: Any) -> bool:
    """H-GEN-4: a string or an integer (not a bool, not null)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


# A client-chosen identifier (a request id, a progressToken) is stored with what it names and
# repeated in every message about it (a listen's notifications, each progress notification): at
# most this many characters (integers are 64-bit at most: larger ones are not JSON we parse).
MAX_ID_CHARS: Final = 256


def id_too_long(value: Any) -> bool:
    return isinstance(value, str) and len(value) > MAX_ID_CHARS
