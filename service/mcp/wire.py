"""2025-11-25 wire shapes of tasks and their outcomes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from service.domain.task import RELATED_TASK, Outcome, OutcomeKind, Task, TaskStatus
from service.mcp.jsonrpc import INVALID_PARAMS, RpcFailure


def iso(ts: datetime) -> str:
    """RFC 3339 UTC with milliseconds, e.g. 2025-11-25T10:30:00.123Z."""
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def task_to_wire(task: Task) -> dict[str, Any]:
    """The Task object (T-CREATE-6, T-TTL-1/2/4, D-11: ttl is always an integer)."""
    out: dict[str, Any] = {
        "taskId": task.task_id,
        "status": task.status.value,
        "createdAt": iso(task.created_at),
        "lastUpdatedAt": iso(task.last_updated_at),
        "ttl": task.ttl_ms,
        "pollInterval": task.poll_interval_ms,
    }
    if task.status_message:
        out["statusMessage"] = task.status_message
    return out


def related(task_id: str) -> dict[str, Any]:
    return {RELATED_TASK: {"taskId": task_id}}


def outcome_result(outcome: Outcome) -> dict[str, Any]:
    """The CallToolResult of an outcome; a JSON-RPC error outcome is raised as stored (T-RES-4, D-2)."""
    if outcome.kind is OutcomeKind.RPC_ERROR:
        p = outcome.payload
        raise RpcFailure(int(p.get("code", -32603)), str(p.get("message", "")), p.get("data"))
    return dict(outcome.payload)


def task_result(task: Task) -> dict[str, Any]:
    """What tasks/result answers for a terminal task (T-RES-2/4/5/6, D-1).

    Raises RpcFailure for a JSON-RPC error outcome and for a cancelled task.
    """
    if task.status is TaskStatus.CANCELLED or task.outcome is None:
        raise RpcFailure(INVALID_PARAMS, "Task was cancelled", {"taskId": task.task_id, "status": task.status.value})
    result = outcome_result(task.outcome)
    result["_meta"] = {**(result.get("_meta") or {}), **related(task.task_id)}
    return result
