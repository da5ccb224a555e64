"""A request's server span (service.observability.tracing), its attributes read from the wire: the
MCP semantic conventions' names, the same on both wires."""

from __future__ import annotations

import contextlib
from typing import Any

from starlette.datastructures import Headers

from service.domain.principal import Caller
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
    attributes: dict[str, Any] = {
        "jsonrpc.request.id": str(message.get("id"))[:256],
        tracing.TENANT_ATTRIBUTE: caller.principal.tenant_id,
    }
    version = protocol_version or headers.get("mcp-protocol-version")
    if version:
        attributes["mcp.protocol.version"] = version[:32]
    if session_id := headers.get("mcp-session-id"):
        attributes["mcp.session.id"] = tracing.session_hash(session_id)
    target = None
    if method == "tools/call" and isinstance(name := params.get("name"), str):
        target = name[:128]
        attributes["gen_ai.tool.name"] = target
        attributes["gen_ai.operation.name"] = "execute_tool"
    if isinstance(task_id := params.get("taskId"), str):
        attributes[tracing.TASK_ATTRIBUTE] = task_id[:8]
    return tracing.server_span(method, target=target, meta=params.get("_meta"),
                               http_traceparent=headers.get("traceparent"), attributes=attributes)  # fmt: skip


def request_failed(code: int | None, outcome: str) -> None:
    """The current request's span ended in an error (its JSON-RPC code), or its client went away."""
    if code is not None:
        tracing.failed(str(code), code)
    elif outcome not in ("ok", "disconnected"):
        tracing.failed(outcome)
