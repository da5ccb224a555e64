"""What happens to a task, as the core tells it to the edge: typed, wire-neutral events."""

from __future__ import annotations

from typing import Any

from service.domain.inputs import PendingInput
from service.domain.task import Task
from service.domain.values import frozen

# Log levels (RFC 5424 severities), lowest first.
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")


@frozen
class StatusChanged:
    task: Task


@frozen
class Progress:
    """A step of a call's progress; ``token`` is the one its creating request gave (T-PROG-1)."""

    task_id: str | None
    token: str | int
    progress: float
    total: float | None = None
    message: str | None = None


@frozen
class LogEntry:
    task_id: str | None
    level: str
    data: Any
    logger: str | None = None


@frozen
class InputRequested:
    task_id: str | None
    input: PendingInput


@frozen
class InputVoided:
    """A question this stream carried can no longer be answered (its task ended, C-10)."""

    task_id: str
    key: str
    reason: str


@frozen
class Finished:
    task: Task


@frozen
class ToolListChanged:
    """The server's tool list changed (not about a task: a session's GET stream carries it)."""


TaskEvent = StatusChanged | Progress | LogEntry | InputRequested | InputVoided | Finished
# What a 2025-11-25 session's GET stream carries.
SessionEvent = TaskEvent | ToolListChanged


def log_wanted(level: str, minimum: str | None) -> bool:
    """Whether a log entry at ``level`` passes a session's chosen minimum level."""
    if level not in LOG_LEVELS:
        return False
    return minimum is None or minimum not in LOG_LEVELS or LOG_LEVELS.index(level) >= LOG_LEVELS.index(minimum)
