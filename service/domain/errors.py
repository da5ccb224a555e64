"""The domain exception tree. No wire codes here: mcp/refusal.py maps each class to a refusal.

DomainError
├── TaskNotFound            unknown, expired, purged, or another principal's task
├── TaskAlreadyTerminal     cancel of a completed/failed/cancelled task
├── InvalidCursor           list cursor that is malformed, forged or another principal's
├── InvalidArguments        tool arguments or request parameters that do not validate
├── UnknownTool
├── TaskSupportMismatch     task-augmented call to a forbidden tool, plain call to a required one
├── CapacityExceeded        per-requestor or per-tenant cap on active tasks
└── Unavailable             the database or another dependency is down
"""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    """Base of every error the use cases raise on purpose."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class TaskNotFound(DomainError):
    pass


class TaskAlreadyTerminal(DomainError):
    pass


class InvalidCursor(DomainError):
    pass


class InvalidArguments(DomainError):
    pass


class UnknownTool(DomainError):
    pass


class TaskSupportMismatch(DomainError):
    pass


class CapacityExceeded(DomainError):
    pass


class StorageQuotaExceeded(CapacityExceeded):
    """A create would take its tenant past the bytes its tasks may keep (its own wire code)."""


class Unavailable(DomainError):
    pass
