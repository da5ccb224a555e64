"""2025-11-25 wire shapes of tasks, their outcomes, events and questions."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any, Final

from service.domain.events import (
    Finished,
    InputRequested,
    InputVoided,
    LogEntry,
    Progress,
    SessionEvent,
    StatusChanged,
    ToolListChanged,
    log_wanted,
)
from service.domain.inputs import InputKind, PendingInput
from service.domain.task import FailureReason, Outcome, OutcomeKind, Task, TaskStatus, ttl_reported_ms
from service.mcp import jsonrpc
from service.mcp.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS
from service.mcp.refusal import Refusal

# The reserved _meta key that ties a message to its task (T-ASSOC-1).
RELATED_TASK: Final = "io.modelcontextprotocol/related-task"

# The request method of each kind of question.
INPUT_METHODS: Final = {
    InputKind.ELICITATION: "elicitation/create",
    InputKind.SAMPLING: "sampling/createMessage",
    InputKind.ROOTS: "roots/list",
}

# The JSON-RPC code of each failure the service itself reports (a tool may name its own).
_FAILURE_CODES: Final = {
    FailureReason.UNKNOWN_TOOL: INVALID_PARAMS,
    FailureReason.INVALID_INPUT: INVALID_PARAMS,
}


def iso(ts: datetime) -> str:
    """RFC 3339 UTC with milliseconds, e.g. 2025-11-25T10:30:00.123Z."""
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def error_object(outcome: Outcome) -> dict[str, Any]:
    """The JSON-RPC error object of a failed call (both wires: replayed, or the extension's ``error``)."""
    p = outcome.payload
    code = p.get("code")
    if not isinstance(code, int) or isinstance(code, bool):
        code = _FAILURE_CODES.get(outcome.failure_reason or FailureReason.INTERNAL, INTERNAL_ERROR)
    error: dict[str, Any] = {"code": code, "message": str(p.get("message", ""))}
    if p.get("data") is not None:
        error["data"] = p["data"]
    return error


def v2025_status(task: Task) -> TaskStatus:
    """T-STATE-7: on 2025-11-25 a result with isError: true ends the task as failed."""
    if task.outcome is not None and task.outcome.kind is OutcomeKind.TOOL_ERROR:
        return TaskStatus.FAILED
    return task.status


def task_to_wire(task: Task) -> dict[str, Any]:
    """The Task object (T-CREATE-6, T-TTL-1/2/4, D-11: ttl is always an integer, the actual one:
    a working task's grows, docs/decisions.md "Retention after the end")."""
    out: dict[str, Any] = {
        "taskId": task.task_id,
        "status": v2025_status(task).value,
        "createdAt": iso(task.created_at),
        "lastUpdatedAt": iso(task.last_updated_at),
        "ttl": ttl_reported_ms(task, datetime.now(UTC)),
        "pollInterval": task.poll_interval_ms,
    }
    if task.status_message:
        out["statusMessage"] = task.status_message
    return out


def related(task_id: str) -> dict[str, Any]:
    return {RELATED_TASK: {"taskId": task_id}}


def outcome_result(outcome: Outcome) -> dict[str, Any]:
    """The CallToolResult of an outcome; a failed call is raised as its JSON-RPC error (T-RES-4, D-2)."""
    if outcome.kind is OutcomeKind.FAILURE:
        error = error_object(outcome)
        raise Refusal(error["code"], error["message"], error.get("data"))
    return dict(outcome.payload)


def task_result(task: Task) -> dict[str, Any]:
    """What tasks/result answers for a terminal task (T-RES-2/4/5/6, D-1).

    Raises Refusal for a failed call and for a cancelled task.
    """
    if task.status is TaskStatus.CANCELLED or task.outcome is None:
        raise Refusal(INVALID_PARAMS, "Task was cancelled", {"taskId": task.task_id, "status": task.status.value})
    result = outcome_result(task.outcome)
    result["_meta"] = {**(result.get("_meta") or {}), **related(task.task_id)}
    return result


def input_request(question: PendingInput, task_id: str | None) -> dict[str, Any]:
    """A question as a server-to-client JSON-RPC request; its id is the question's key (T-INPUT-5)."""
    params = dict(question.params)
    if task_id is not None:
        params["_meta"] = related(task_id)
    return jsonrpc.request(question.key, INPUT_METHODS[question.kind], params)


def event_message(
    event: SessionEvent, request_id: jsonrpc.RequestId | None, log_level: str | None
) -> dict[str, Any] | None:
    """A task event as the message a 2025-11-25 stream carries (None: nothing to send)."""
    if isinstance(event, ToolListChanged):
        return jsonrpc.notification("notifications/tools/list_changed", {})
    if isinstance(event, InputRequested):
        return input_request(event.input, event.task_id)
    if isinstance(event, Progress):
        params: dict[str, Any] = {"progressToken": event.token, "progress": event.progress}
        if event.total is not None:
            params["total"] = event.total
        if event.message is not None:
            params["message"] = event.message
        if event.task_id is not None:
            params["_meta"] = related(event.task_id)
        return jsonrpc.notification("notifications/progress", params)
    if isinstance(event, LogEntry):
        if not log_wanted(event.level, log_level):
            return None
        params = {"level": event.level, "data": event.data}
        if event.logger:
            params["logger"] = event.logger
        if event.task_id is not None:
            params["_meta"] = related(event.task_id)
        return jsonrpc.notification("notifications/message", params)
    if isinstance(event, InputVoided):
        params = {"requestId": event.key, "reason": event.reason, "_meta": related(event.task_id)}
        return jsonrpc.notification("notifications/cancelled", params)
    if isinstance(event, StatusChanged):
        return jsonrpc.notification("notifications/tasks/status", task_to_wire(event.task))
    assert isinstance(event, Finished)
    assert request_id is not None
    try:
        return jsonrpc.result_message(request_id, task_result(event.task))
    except Refusal as failure:
        return jsonrpc.error_message(request_id, failure.error_object())


def progress_token_of(params: dict[str, Any]) -> str | int | None:
    """The request's _meta.progressToken (T-PROG-1), bounded like every client-chosen identifier."""
    meta = params.get("_meta")
    if not isinstance(meta, dict) or "progressToken" not in meta:
        return None
    token = meta["progressToken"]
    if not jsonrpc.valid_id(token) or jsonrpc.id_too_long(token):
        raise Refusal(INVALID_PARAMS, f"_meta.progressToken must be an integer or a string of at most "
                                      f"{jsonrpc.MAX_ID_CHARS} characters")  # fmt: skip
    return token  # type: ignore[no-any-return]


def task_ttl_of(task_param: Any) -> int | None:
    """D-14: params.task must be an object; ttl a non-negative integer, or absent/null."""
    if not isinstance(task_param, dict):
        raise Refusal(INVALID_PARAMS, 'params.task must be an object such as {} or {"ttl": 60000}')
    ttl = task_param.get("ttl")
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) or ttl != int(ttl):
        raise Refusal(INVALID_PARAMS, "params.task.ttl must be a non-negative integer number of milliseconds")
    return int(ttl)
