"""Refusals: the one error type of the MCP edge, and the one place that maps and answers them.

Every layer of the edge refuses a request by raising ``Refusal``: an HTTP status, a JSON-RPC error
(code, message, data), the headers to send, and the request's id once it is known (a refusal
before the id was read goes out with ``id: null``, H-POST-3). What the layers below raise is
mapped here and nowhere else (``refusal_of``): a domain error by the table below, per wire (the
2026-07-28 wire moves our codes out of the reserved range, X-ERR-2), an authentication failure
with its challenge. ``answer`` writes a refusal.

    Exception
    ├── Refusal              raised by the edge itself
    ├── AuthFailure          (auth) 401/403 with WWW-Authenticate
    └── DomainError          (domain) mapped by _CODES
"""

from __future__ import annotations

from typing import Any, Final

from starlette.types import Send

from service.auth.base import AuthFailure
from service.domain import errors as d
from service.domain.task import Wire
from service.mcp import jsonrpc
from service.mcp.http import send_json
from service.mcp.jsonrpc import (
    CAPACITY_EXCEEDED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    SERVICE_UNAVAILABLE,
    STORAGE_QUOTA_EXCEEDED,
    V2026_CAPACITY_EXCEEDED,
    V2026_SERVICE_UNAVAILABLE,
    V2026_STORAGE_QUOTA_EXCEEDED,
    RequestId,
)


class Refusal(Exception):
    """A request refused: answered with ``status`` and a JSON-RPC error (``code``, ``message``,
    ``data``) for ``request_id`` (None: not known, or not readable), with ``headers``. An
    ``envelope`` refusal refuses the HTTP request itself (its method, a header, its body, its
    session), and is answered without the JSON-RPC request's id even once that is known."""

    def __init__(
        self, code: int, message: str, data: Any = None, *, status: int = 200, headers: dict[str, str] | None = None,
        request_id: RequestId | None = None, envelope: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.status = status
        self.headers = headers or {}
        self.request_id = request_id
        self.envelope = envelope

    def error_object(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            err["data"] = self.data
        return err


def http_refusal(
    status: int, message: str, headers: dict[str, str] | None = None, *, code: int = INVALID_REQUEST
) -> Refusal:
    """A refusal of the HTTP envelope (a method, a header, a body, a session): no JSON-RPC id."""
    return Refusal(code, message, status=status, headers=headers, envelope=True)


_CODES: Final[dict[type[d.DomainError], int]] = {
    d.TaskNotFound: INVALID_PARAMS,  # T-GET-2, T-RES-7, T-CANCEL-3; foreign tasks look the same
    d.TaskAlreadyTerminal: INVALID_PARAMS,  # T-CANCEL-2
    d.InvalidCursor: INVALID_PARAMS,  # T-LIST-5
    d.InvalidArguments: INVALID_PARAMS,  # T-TOOL-6
    d.UnknownTool: INVALID_PARAMS,  # T-TOOL-6
    d.TaskSupportMismatch: METHOD_NOT_FOUND,  # T-TOOL-3, T-TOOL-5, D-3, D-4
    d.CapacityExceeded: CAPACITY_EXCEEDED,
    d.StorageQuotaExceeded: STORAGE_QUOTA_EXCEEDED,
    d.Unavailable: SERVICE_UNAVAILABLE,
}
# 2026-07-28 keeps the standard codes and moves ours out of the reserved range (X-ERR-2).
_V2026_CODES: Final[dict[int, int]] = {
    CAPACITY_EXCEEDED: V2026_CAPACITY_EXCEEDED,
    STORAGE_QUOTA_EXCEEDED: V2026_STORAGE_QUOTA_EXCEEDED,
    SERVICE_UNAVAILABLE: V2026_SERVICE_UNAVAILABLE,
}


def from_domain(exc: d.DomainError, *, wire: Wire = Wire.V2025, request_id: RequestId | None = None) -> Refusal:
    code = _CODES.get(type(exc), INTERNAL_ERROR)
    if wire is Wire.V2026:
        code = _V2026_CODES.get(code, code)
    if isinstance(exc, d.Unavailable):
        return Refusal(code, "the service is temporarily unavailable (database unreachable); retry shortly",
                       status=503, headers={"Retry-After": "2"}, request_id=request_id)  # fmt: skip
    return Refusal(code, exc.message, dict(exc.details) or None, request_id=request_id)


def refusal_of(exc: BaseException, *, wire: Wire = Wire.V2025, request_id: RequestId | None = None) -> Refusal | None:
    """What the client is answered for ``exc``; None for what no layer raises on purpose (a bug:
    the caller logs it with a reference)."""
    if isinstance(exc, Refusal):
        if exc.request_id is None and not exc.envelope:
            exc.request_id = request_id
        return exc
    if isinstance(exc, AuthFailure):
        return Refusal(INVALID_REQUEST, exc.description, status=exc.status, headers=exc.headers, envelope=True)
    if isinstance(exc, d.DomainError):
        refusal = from_domain(exc, wire=wire, request_id=request_id)
        if request_id is None and refusal.status == 200:  # a domain error before any JSON-RPC request
            refusal.status = 503
        return refusal
    return None


async def answer(send: Send, refusal: Refusal) -> None:
    """The one place a refusal is written."""
    await send_json(send, refusal.status, jsonrpc.error_message(refusal.request_id, refusal.error_object()),
                    refusal.headers)  # fmt: skip
