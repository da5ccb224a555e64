"""The one table from domain errors to JSON-RPC errors (and HTTP statuses where they differ)."""

from __future__ import annotations

from service.domain import errors as d
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


def to_rpc(exc: d.DomainError) -> RpcFailure:
    code = _CODES.get(type(exc), INTERNAL_ERROR)
    data = dict(exc.details) or None
    if isinstance(exc, d.Unavailable):
        return RpcFailure(
            code,
            "the service is temporarily unavailable (database unreachable); retry shortly",
            http_status=503,
            headers={"Retry-After": "2"},
        )
    return RpcFailure(code, exc.message, data)
