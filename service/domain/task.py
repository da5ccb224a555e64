"""Task, its status machine and its wire-neutral outcome."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

# The reserved _meta key that ties a message to its task (T-ASSOC-1).
RELATED_TASK = "io.modelcontextprotocol/related-task"


class TaskStatus(enum.StrEnum):
    WORKING = "working"
    INPUT_REQUIRED = "input_required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED})


class OutcomeKind(enum.StrEnum):
    """How the underlying request ended, independent of any wire surface."""

    RESULT = "result"  # a CallToolResult without isError
    TOOL_ERROR = "tool_error"  # a CallToolResult with isError: true
    RPC_ERROR = "rpc_error"  # a JSON-RPC error {code, message, data?}


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: OutcomeKind
    payload: dict[str, Any]

    @property
    def status(self) -> TaskStatus:
        """The 2025-11-25 status this outcome gives a task (T-STATE-5, T-STATE-7)."""
        return TaskStatus.COMPLETED if self.kind is OutcomeKind.RESULT else TaskStatus.FAILED

    @property
    def status_message(self) -> str | None:
        if self.kind is OutcomeKind.RPC_ERROR:
            return str(self.payload.get("message", "the tool failed"))
        if self.kind is OutcomeKind.TOOL_ERROR:
            texts = [c.get("text", "") for c in self.payload.get("content", []) if isinstance(c, dict)]
            text = " ".join(t for t in texts if t)
            return text[:500] or "the tool reported an error"
        return None


@dataclass(frozen=True, slots=True)
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


def new_task_id() -> str:
    """T-CREATE-4, T-SEC-3: 256 bits from the OS CSPRNG, URL-safe."""
    return secrets.token_urlsafe(32)


def clamp_ttl(requested: int | None, *, default_ms: int, min_ms: int, max_ms: int) -> int:
    """T-TTL-7 / D-14: absent → default; unlimited is never granted; clamp into [min, max]."""
    if requested is None:
        return default_ms
    return max(min_ms, min(requested, max_ms))
