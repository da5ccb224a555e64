"""Rows to domain values, and the audit append every transaction of the store shares."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import asyncpg

from service.domain.principal import Caller
from service.domain.task import Outcome, OutcomeKind, Task, TaskStatus
from service.store.queries import Q
from service.store.requests import CreateRequest

# Stored values to their enums by a dict lookup (calling an enum class costs ten times as much;
# a row becomes a Task several times per lifecycle).
_STATUSES: dict[str, TaskStatus] = {status.value: status for status in TaskStatus}
_OUTCOMES: dict[str, OutcomeKind] = {kind.value: kind for kind in OutcomeKind}


class Keyed(Protocol):
    @property
    def tenant_id(self) -> str: ...

    @property
    def task_id(self) -> str: ...


def task_from_row(
    row: asyncpg.Record,
    arguments: dict[str, Any] | None = None,
    client_capabilities: dict[str, Any] | None = None,
) -> Task:
    """A task from its row. Lists and lookups read only the columns they answer with (issue 14
    §4): the arguments, the capabilities and (lists) the payload they leave out come back empty.
    ``arguments`` and ``client_capabilities``: what the row was written with, not read back."""
    outcome = None
    if row["outcome"] is not None:
        outcome = Outcome(_OUTCOMES[row["outcome"]], row.get("payload") or {})
    return Task(
        tenant_id=row["tenant_id"],
        task_id=row["task_id"],
        subject=row["subject"],
        tool=row["tool"],
        status=_STATUSES[row["status"]],
        status_message=row["status_message"],
        ttl_ms=row["ttl_ms"],
        poll_interval_ms=row["poll_interval_ms"],
        created_at=row["created_at"],
        last_updated_at=row["last_updated_at"],
        outcome=outcome,
        arguments=(row.get("arguments") or {}) if arguments is None else arguments,
        session_id=row["session_id"],
        progress_token=row["progress_token"],
        client_capabilities=(row.get("client_capabilities") or {})
        if client_capabilities is None
        else client_capabilities,
        attempts=row["attempts"],
        client_id=row["client_id"],
        issuer=row["issuer"],
        wire=row["wire"],
        rerunnable=row.get("rerunnable"),
        lease_epoch=row.get("lease_epoch") or 0,  # a runner's copy always has it (claims read every column)
        started_at=row.get("started_at"),
        expires_at=row.get("expires_at"),
        trace_parent=row.get("trace_parent"),
    )


def task_or_none(row: asyncpg.Record | None) -> Task | None:
    return task_from_row(row) if row is not None else None


def matched(requests: Sequence[Keyed], rows: list[asyncpg.Record]) -> list[Task | None]:
    """One task (or None) per request, checked to be the request's own: answers are handed out by
    position, so a row that is not its request's task fails the batch instead of reaching anyone.
    A create's task takes its arguments and capabilities from its request (not read back)."""
    tasks: list[Task | None] = []
    for request, row in zip(requests, rows, strict=True):  # a missing or extra row raises
        if row["task_id"] is None:
            tasks.append(None)
        elif (row["tenant_id"], row["task_id"]) != (request.tenant_id, request.task_id):
            raise RuntimeError("a batch returned a row for another request")
        elif isinstance(request, CreateRequest):
            tasks.append(task_from_row(row, request.arguments, request.client_capabilities))
        else:
            tasks.append(task_from_row(row))
    return tasks


async def append_audit(
    conn: asyncpg.Connection,
    tenant_id: str,
    action: str,
    outcome: str,
    *,
    subject: str = "",
    client_id: str = "",
    issuer: str = "",
    task_id: str | None = None,
    request_id: str | None = None,
    address: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """Append to the tenant's hash chain inside the current transaction."""
    await conn.execute(
        Q["append_audit"], tenant_id, action, outcome, subject, client_id, issuer, task_id, request_id, address, detail
    )


async def append_audit_for(
    conn: asyncpg.Connection, caller: Caller, action: str, outcome: str, task_id: str | None = None, **detail: Any
) -> None:
    p = caller.principal
    await append_audit(
        conn,
        p.tenant_id,
        action,
        outcome,
        subject=p.subject,
        client_id=p.client_id,
        issuer=p.issuer,
        task_id=task_id,
        request_id=caller.request_id,
        address=caller.address,
        detail=detail or None,
    )
