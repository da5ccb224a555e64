"""2026-07-28 wire shapes: the Tasks extension (io.modelcontextprotocol/tasks) and the core's `_meta`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Final

from service import __version__
from service.domain.inputs import PendingInput
from service.domain.task import OutcomeKind, Task, TaskStatus, ttl_reported_ms
from service.mcp import jsonrpc
from service.mcp.v2025_wire import INPUT_METHODS, error_object, iso

VERSION: Final = "2026-07-28"
EXTENSION: Final = "io.modelcontextprotocol/tasks"
META_VERSION: Final = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES: Final = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT_INFO: Final = "io.modelcontextprotocol/clientInfo"
META_LOG_LEVEL: Final = "io.modelcontextprotocol/logLevel"
META_SERVER_INFO: Final = "io.modelcontextprotocol/serverInfo"
META_SUBSCRIPTION: Final = "io.modelcontextprotocol/subscriptionId"

# The JSON-RPC codes of 2026-07-28 live with the others (jsonrpc.py), named here as this wire says them.
HEADER_MISMATCH: Final = jsonrpc.V2026_HEADER_MISMATCH
MISSING_CAPABILITY: Final = jsonrpc.V2026_MISSING_CAPABILITY
UNSUPPORTED_VERSION: Final = jsonrpc.V2026_UNSUPPORTED_VERSION
CAPACITY_EXCEEDED: Final = jsonrpc.V2026_CAPACITY_EXCEEDED
SERVICE_UNAVAILABLE: Final = jsonrpc.V2026_SERVICE_UNAVAILABLE
RATE_LIMITED: Final = jsonrpc.V2026_RATE_LIMITED

SERVER_INFO: Final = {"name": "mcp-task-service", "title": "MCP Task Service", "version": __version__}
REQUIRED_CAPABILITIES: Final[dict[str, Any]] = {"extensions": {EXTENSION: {}}}


def server_meta() -> dict[str, Any]:
    """X-CREATE-10: every result names the server."""
    return {META_SERVER_INFO: SERVER_INFO}


def complete(result: dict[str, Any]) -> dict[str, Any]:
    """A result of the 2026-07-28 core: ``resultType`` and the server's ``_meta``."""
    meta = {**server_meta(), **(result.get("_meta") or {})}
    return {**result, "resultType": "complete", "_meta": meta}


def task_fields(task: Task) -> dict[str, Any]:
    """The Task object: ``ttlMs`` and ``pollIntervalMs`` as integers (X-TTL-1, X-TTL-7); ``ttlMs``
    the current value, which grows while the task works (X-TTL-2, "Retention after the end")."""
    out: dict[str, Any] = {
        "taskId": task.task_id,
        "status": task.status.value,  # a tool error is completed here (X-STATE-4): the stored status
        "createdAt": iso(task.created_at),
        "lastUpdatedAt": iso(task.last_updated_at),
        "ttlMs": ttl_reported_ms(task, datetime.now(UTC)),
        "pollIntervalMs": task.poll_interval_ms,
    }
    if task.status_message:
        out["statusMessage"] = task.status_message
    return out


def created(task: Task) -> dict[str, Any]:
    """CreateTaskResult: flat, ``resultType: "task"`` (X-CREATE-1, X-NEG-14)."""
    return {**task_fields(task), "resultType": "task", "_meta": server_meta()}


def input_requests(pending: list[PendingInput] | tuple[PendingInput, ...]) -> dict[str, Any]:
    """InputRequests: key → {method, params}, nothing else (X-INPUT-2)."""
    return {q.key: {"method": INPUT_METHODS[q.kind], "params": q.params} for q in pending}


def call_result(payload: dict[str, Any]) -> dict[str, Any]:
    """A CallToolResult of 2026-07-28 (``resultType`` required; XD-13 inside a task too)."""
    return {**payload, "resultType": "complete"}


def detailed(task: Task, pending: list[PendingInput]) -> dict[str, Any]:
    """DetailedTask: the task with its result, error or open questions inline (X-GET-2..6)."""
    out = task_fields(task)
    if task.status is TaskStatus.INPUT_REQUIRED:
        out["inputRequests"] = input_requests(pending)
    elif task.outcome is not None and task.status is TaskStatus.COMPLETED:
        out["result"] = call_result(task.outcome.payload)
    elif task.outcome is not None and task.outcome.kind is OutcomeKind.FAILURE:
        out["error"] = error_object(task.outcome)
    return out
