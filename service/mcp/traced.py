"""A request's server span (service.observability.tracing), its attributes read from the wire: the
MCP semantic conventions' names, the same on both wires."""

from __future__ import annotations

import contextlib
from typing import Any

from starlette.datastructures import Headers

from service.domain.principal import Caller
from service.observability import logging as logctx
from service.observability import tracing


def request_span(
    method: str, message: dict[str, Any], headers: Headers, caller: Caller, *, protocol_version: str | None
) -> contextlib.AbstractContextManager[Any]:
    """The server span of one JSON-RPC request (nothing while tracing is off). ``method`` is the
    bounded method label; ``protocol_version`` the wire's (2026-07-28), else the header's."""
    if not tracing.enabled():
        return tracing.NO_SPAN
    params = message.get("params")
    params = params if isinstance(params, dict) else {}
    target = params.get("name") if method == "tools/call" else None
    target = target[:128] if isinstance(target, str) else None

    def attributes() -> dict[str, Any]:  # read only for a span that may be recorded
        out: dict[str, Any] = {
            "jsonrpc.request.id": str(message.get("id"))[:256],
            tracing.TENANT_ATTRIBUTE: caller.principal.tenant_id,
        }
        version = protocol_version or headers.get("mcp-protocol-version")
        if version:
            out["mcp.protocol.version"] = version[:32]
        if session_id := headers.get("mcp-session-id"):
            out["mcp.session.id"] = tracing.session_hash(session_id)
        if target is not None:
            out["gen_ai.tool.name"] = target
            out["gen_ai.operation.name"] = "execute_tool"
        if isinstance(task_id := params.get("taskId"), str):
            out[tracing.TASK_ATTRIBUTE] = task_id[:8]
        return out

    span = tracing.server_span(method, target=target, meta=params.get("_meta"),
                               http_traceparent=headers.get("traceparent"), attributes=attributes)  # fmt: skip
    return _Noted(span)


class _Noted:
    """The span, its ids noted for the request's log lines (the request line is written after it ends)."""

    __slots__ = ("span",)

    def __init__(self, span: contextlib.AbstractContextManager[Any]) -> None:
        self.span = span

    def __enter__(self) -> Any:
        current = self.span.__enter__()
        logctx.note_trace(tracing.current_ids())
        return current

    def __exit__(self, *exc: Any) -> bool | None:
        return self.span.__exit__(*exc)


def request_failed(code: int | None, outcome: str) -> None:
    """The current request's span ended in an error (its JSON-RPC code), or its client went away."""
    if code is not None:
        tracing.failed(str(code), code)
    elif outcome not in ("ok", "disconnected"):
        tracing.failed(outcome)
