"""Task, its status machine and its wire-neutral outcome."""

from __future__ import annotations

import enum
import secrets
from dataclasses import field
from datetime import datetime, timedelta
from typing import Any

from service.domain.values import frozen


class TaskStatus(enum.StrEnum):
    """The stored status. A finished call is ``completed`` whatever its result says (a tool error
    is a result too) and ``failed`` only when the call itself failed; each wire renders it."""

    WORKING = "working"
    INPUT_REQUIRED = "input_required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED})
ACTIVE_STATUSES = frozenset({TaskStatus.WORKING, TaskStatus.INPUT_REQUIRED})


class OutcomeKind(enum.StrEnum):
    """How the underlying call ended, independent of any wire."""

    RESULT = "result"  # the tool returned a result
    TOOL_ERROR = "tool_error"  # the tool returned a result that reports an error
    FAILURE = "failure"  # the call failed: no result (see FailureReason)


class FailureReason(enum.StrEnum):
    """Why a call failed; the edge picks the error code for each (a tool may name its own)."""

    TOOL = "tool"  # the tool ended the call with a failure of its own
    INTERNAL = "internal"  # the tool raised something unexpected
    UNKNOWN_TOOL = "unknown_tool"  # no tool of that name (here)
    INVALID_INPUT = "invalid_input"  # the client's answer to a question was not usable
    RUNNER_STOPPED = "runner_stopped"  # the process running it stopped and it may not run again
    UNSTORABLE = "unstorable"  # the result could not be stored
    RUNTIME_LIMIT = "runtime_limit"  # it ran longer than its tool's runtime limit
    INPUT_TIMEOUT = "input_timeout"  # no answer came to its question in time


@frozen
class Outcome:
    """A finished call. ``payload`` is the result for RESULT and TOOL_ERROR, and
    ``{"reason", "message", "code"?, "data"?}`` for FAILURE."""

    kind: OutcomeKind
    payload: dict[str, Any]

    @classmethod
    def failure(cls, reason: FailureReason, message: str, *, code: int | None = None, data: Any = None) -> Outcome:
        payload: dict[str, Any] = {"reason": reason.value, "message": message}
        if code is not None:
            payload["code"] = code
        if data is not None:
            payload["data"] = data
        return cls(OutcomeKind.FAILURE, payload)

    @property
    def status(self) -> TaskStatus:
        """The stored status of a task that ends so: only a failed call is ``failed``."""
        return TaskStatus.FAILED if self.kind is OutcomeKind.FAILURE else TaskStatus.COMPLETED

    @property
    def failure_reason(self) -> FailureReason | None:
        if self.kind is not OutcomeKind.FAILURE:
            return None
        try:
            return FailureReason(self.payload.get("reason", FailureReason.INTERNAL.value))
        except ValueError:
            return FailureReason.INTERNAL

    @property
    def status_message(self) -> str | None:
        if self.kind is OutcomeKind.FAILURE:
            return str(self.payload.get("message", "the tool failed"))
        if self.kind is OutcomeKind.TOOL_ERROR:
            texts = [c.get("text", "") for c in self.payload.get("content", []) if isinstance(c, dict)]
            text = " ".join(t for t in texts if t)
            return text[:500] or "the tool reported an error"
        return None


class Wire(enum.StrEnum):
    """The two wires: MCP 2025-11-25 Tasks and the 2026-07-28 Tasks extension. A task keeps the one
    it was created through (it decides who may see it, XD-3)."""

    V2025 = "2025-11-25"
    V2026 = "2026-07-28"


@frozen
class Task:
    tenant_id: str
    task_id: str
    subject: str
    tool: str
    status: TaskStatus
    status_message: str | None
    ttl_ms: int
    poll_interval_ms: int
    created_at: datetime
    last_updated_at: datetime
    outcome: Outcome | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None
    progress_token: str | int | None = None
    client_capabilities: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0
    client_id: str = ""
    issuer: str = ""
    wire: str = Wire.V2025.value
    # Whether its tool may run again after a lost run, as recorded at create (None: not recorded).
    rerunnable: bool | None = None
    # With the runner's owner name, the fencing token of the lease this copy was read under.
    lease_epoch: int = 0
    # When a runner first started it (kept across takeovers: the runtime limit counts from it).
    started_at: datetime | None = None
    # When it will be deleted; None where the copy was read without it. PostgreSQL's 'infinity'
    # (a started task, while it works) reads as a naive datetime.max.
    expires_at: datetime | None = None
    # The creating request's W3C traceparent (tracing on): its run is a child of that request.
    trace_parent: str | None = None


def ttl_reported_ms(task: Task, now: datetime) -> int:
    """The task's ttl as both wires report it, from its creation to when it will be deleted. The
    granted ttl is retention after the last change once the task stops working (ends, waits for
    input or for a runner): its expiry is then that change plus the ttl, and the value stands. A
    started task has no expiry while it works: the value grows by its age, so createdAt + ttl stays
    a retention period ahead. Ages count in whole seconds: the value moves at most once a second,
    a task just created reports what it was granted, and it never names a later expiry than the
    real one (docs/decisions.md, D-12)."""
    expires = task.expires_at
    if expires is not None and expires.tzinfo is not None:  # finite: the change it counts from
        anchor = expires - timedelta(milliseconds=task.ttl_ms)
    elif expires is None and task.status is not TaskStatus.WORKING:  # read without it
        anchor = task.last_updated_at
    else:
        anchor = now
    return task.ttl_ms + 1000 * max(0, int((anchor - task.created_at).total_seconds()))


def new_task_id() -> str:
    """T-CREATE-4, T-SEC-3: 256 bits from the OS CSPRNG, URL-safe."""
    return secrets.token_urlsafe(32)


def clamp_ttl(requested: int | None, *, default_ms: int, min_ms: int, max_ms: int) -> int:
    """T-TTL-7 / D-14: absent → default; unlimited is never granted; clamp into [min, max]."""
    if requested is None:
        return default_ms
    return max(min_ms, min(requested, max_ms))
