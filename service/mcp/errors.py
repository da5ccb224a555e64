"""The one table from domain errors to JSON-RPC errors (and HTTP statuses where they differ)."""

from __future__ import annotations

from service.domain import errors as d
from service.mcp.ext_wire import CAPACITY_EXCEEDED as MODERN_CAPACITY_EXCEEDED
from service.mcp.ext_wire import SERVICE_UNAVAILABLE as MODERN_SERVICE_UNAVAILABLE
from service.mcp.jsonrpc import (
    CAPACITY_EXCEEDED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    SERVICE_UNAVAILABLE,
    RpcFailure,
)

_CODES: dict[type[d.DomainError], int] = {
    d.TaskNotFound: INVALID_PARAMS,  # T-GET-2, T-RES-7, T-CANCEL-3; foreign tasks look the same
    d.TaskAlreadyTerminal: INVALID_PARAMS,  # T-CANCEL-2
    d.InvalidCursor: INVALID_PARAMS,  # T-LIST-5
    d.InvalidArguments: INVALID_PARAMS,  # T-TOOL-6
    d.UnknownTool: INVALID_PARAMS,  # T-TOOL-6
    d.TaskSupportMismatch: METHOD_NOT_FOUND,  # T-TOOL-3, T-TOOL-5, D-3, D-4
    d.CapacityExceeded: CAPACITY_EXCEEDED,
    d.Unavailable: SERVICE_UNAVAILABLE,
}


# 2026-07-28 keeps the standard codes and moves ours out of the reserved range (X-ERR-2).
_MODERN_CODES: dict[int, int] = {
    CAPACITY_EXCEEDED: MODERN_CAPACITY_EXCEEDED,
    SERVICE_UNAVAILABLE: MODERN_SERVICE_UNAVAILABLE,
}


def to_rpc(exc: d.DomainError, *, modern: bool = False) -> RpcFailure:
    code = _CODES.get(type(exc), INTERNAL_ERROR)
    if modern:
        code = _MODERN_CODES.get(code, code)
    data = dict(exc.details) or None
    if isinstance(exc, d.Unavailable):
        return RpcFailure(
            code,
            "the service is temporarily unavailable (database unreachable); retry shortly",
            http_status=503,
            headers={"Retry-After": "2"},
        )
    return RpcFailure(code, exc.message, data)
