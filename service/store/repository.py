"""Task, message, session and key repositories: named SQL in, domain objects out."""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

import asyncpg

from service.domain.principal import Principal
from service.domain.task import Outcome, OutcomeKind, Task, TaskStatus
from service.store.queries import Q


def task_from_row(row: asyncpg.Record) -> Task:
    outcome = None
    if row["outcome"] is not None:
        outcome = Outcome(OutcomeKind(row["outcome"]), row["payload"])
    return Task(
        tenant_id=row["tenant_id"],
        task_id=row["task_id"],
        subject=row["subject"],
        tool=row["tool"],
        status=TaskStatus(row["status"]),
        status_message=row["status_message"],
        ttl_ms=row["ttl_ms"],
        poll_interval_ms=row["poll_interval_ms"],
        created_at=row["created_at"],
        last_updated_at=row["last_updated_at"],
        outcome=outcome,
        arguments=row["arguments"],
        session_id=row["session_id"],
        progress_token=row["progress_token"],
        client_capabilities=row["client_capabilities"],
        attempts=row["attempts"],
        client_id=row["client_id"],
        issuer=row["issuer"],
    )


def _task_or_none(row: asyncpg.Record | None) -> Task | None:
    return task_from_row(row) if row is not None else None


# --- tasks ------------------------------------------------------------------------------------


# --- batched requests (migration 0005) ---------------------------------------------------------
#
# A request is a dict in the shape of the SQL type task_batch_item (k: create, retrieve or get), so
# many travel as one jsonb argument of task_batch; each can also be sent alone to its 0004 function.

BatchItem = dict[str, Any]


def create_item(
    *,
    principal: Principal,
    task_id: str,
    session_id: str | None,
    surface: str,
    tool: str,
    arguments: dict[str, Any],
    client_capabilities: dict[str, Any],
    progress_token: str | int | None,
    ttl_ms: int,
    poll_interval_ms: int,
    max_per_requestor: int,
    max_per_tenant: int,
    request_id: str | None,
    address: str | None,
    detail: dict[str, Any],
    lease: tuple[str, int, int] | None = None,
) -> BatchItem:
    """A create under the caps; ``lease`` (owner, liveness key, milliseconds) creates it already
    leased to a local runner."""
    owner, key, lease_ms = lease if lease is not None else (None, None, None)
    return {
        "k": "create",
        "tenant_id": principal.tenant_id,
        "task_id": task_id,
        "subject": principal.subject,
        "issuer": principal.issuer,
        "client_id": principal.client_id,
        "session_id": session_id,
        "surface": surface,
        "tool": tool,
        "arguments": arguments,
        "client_capabilities": client_capabilities,
        "progress_token": progress_token,
        "ttl_ms": ttl_ms,
        "poll_interval_ms": poll_interval_ms,
        "max_per_requestor": max_per_requestor,
        "max_per_tenant": max_per_tenant,
        "request_id": request_id,
        "client_address": address,
        "detail": detail,
        "lease_owner": owner,
        "lease_key": key,
        "lease_ms": lease_ms,
    }


def lookup_item(
    principal: Principal, task_id: str, *, retrieve: bool, request_id: str | None = None, address: str | None = None
) -> BatchItem:
    """The principal's unexpired task; ``retrieve`` audits the hand-out when it is terminal."""
    return {
        "k": "retrieve" if retrieve else "get",
        "tenant_id": principal.tenant_id,
        "task_id": task_id,
        "subject": principal.subject,
        "issuer": principal.issuer,
        "client_id": principal.client_id,
        "request_id": request_id,
        "client_address": address,
    }


def batch_order(item: BatchItem) -> tuple[str, str, str]:
    """The order of a batch: counters and rows are locked in (tenant, subject, task) order."""
    return (item["tenant_id"], item["subject"], item["task_id"])


async def run_batch(conn: asyncpg.Connection, items: list[BatchItem]) -> list[Task | None]:
    """Every item in one statement (its own transaction); None where there is no task for it (a cap
    refused the create, or the task is unknown, expired or someone else's)."""
    return _matched(items, await conn.fetch(Q["task_batch"], items))


def _matched(items: list[BatchItem], rows: list[asyncpg.Record]) -> list[Task | None]:
    """One task (or None) per item, checked to be the item's own: answers are handed out by
    position, so a row that is not its item's task fails the batch instead of reaching anyone."""
    tasks: list[Task | None] = []
    for item, row in zip(items, rows, strict=True):  # a missing or extra row raises
        if row["task_id"] is None:
            tasks.append(None)
        elif (row["tenant_id"], row["task_id"]) != (item["tenant_id"], item["task_id"]):
            raise RuntimeError("a batch returned a row for another item")
        else:
            tasks.append(task_from_row(row))
    return tasks


async def run_item(conn: asyncpg.Connection, item: BatchItem) -> Task | None:
    """One item alone, through its single-request function."""
    if item["k"] == "create":
        row = await conn.fetchrow(
            Q["create_task_checked"],
            *(item[f] for f in _CREATE_FIELDS),
        )
    elif item["k"] == "retrieve":
        row = await conn.fetchrow(
            Q["retrieve_task"],
            *(
                item[f]
                for f in ("tenant_id", "task_id", "subject", "client_id", "issuer", "request_id", "client_address")
            ),
        )
    else:
        row = await conn.fetchrow(Q["get_task_scoped"], item["tenant_id"], item["task_id"], item["subject"])
    return _task_or_none(row)


# task_create's parameters, in order.
_CREATE_FIELDS = (
    "tenant_id", "task_id", "subject", "issuer", "client_id", "session_id", "surface", "tool", "arguments",
    "client_capabilities", "progress_token", "ttl_ms", "poll_interval_ms", "max_per_requestor", "max_per_tenant",
    "request_id", "client_address", "detail", "lease_owner", "lease_key", "lease_ms",
)  # fmt: skip


async def get_leased_task(conn: asyncpg.Connection, tenant_id: str, task_id: str, owner: str) -> Task | None:
    """A task as its runner sees it, if it is active and leased to ``owner`` (runner role)."""
    return _task_or_none(await conn.fetchrow(Q["get_leased_task"], tenant_id, task_id, owner))


async def get_task(conn: asyncpg.Connection, principal: Principal, task_id: str) -> Task | None:
    return _task_or_none(await conn.fetchrow(Q["get_task"], principal.tenant_id, task_id, principal.subject))


async def list_tasks(
    conn: asyncpg.Connection, principal: Principal, *, after: tuple[datetime, str] | None, limit: int
) -> list[Task]:
    if after is None:
        rows = await conn.fetch(Q["list_tasks_first"], principal.tenant_id, principal.subject, limit)
    else:
        rows = await conn.fetch(
            Q["list_tasks_after"], principal.tenant_id, principal.subject, after[0], after[1], limit
        )
    return [task_from_row(r) for r in rows]


async def cancel_task(conn: asyncpg.Connection, principal: Principal, task_id: str, message: str) -> Task | None:
    row = await conn.fetchrow(Q["cancel_task"], principal.tenant_id, task_id, principal.subject, message)
    return _task_or_none(row)


def finish_item(task: Task, owner: str, outcome: Outcome, detail: dict[str, Any]) -> BatchItem:
    """A runner's outcome, in the shape of the SQL type task_finish_item."""
    return {
        "tenant_id": task.tenant_id,
        "task_id": task.task_id,
        "subject": task.subject,  # orders the batch; not a field of task_finish_item
        "owner": owner,
        "status": outcome.status.value,
        "outcome": outcome.kind.value,
        "payload": outcome.payload,
        "status_message": outcome.status_message,
        "detail": detail,
    }


async def finish_batch(conn: asyncpg.Connection, items: list[BatchItem]) -> list[Task | None]:
    """Record outcomes (only where the owner still holds the lease of an active task), their audit
    events and status wake-ups, in one statement; None where the task was no longer the owner's."""
    return _matched(items, await conn.fetch(Q["finish_task_batch"], items))


async def finish_one(conn: asyncpg.Connection, item: BatchItem) -> Task | None:
    """One outcome alone, through task_finish."""
    row = await conn.fetchrow(
        Q["finish_task_audited"],
        *(
            item[f]
            for f in ("tenant_id", "task_id", "owner", "status", "outcome", "payload", "status_message", "detail")
        ),
    )
    return _task_or_none(row)


async def set_active_status(
    conn: asyncpg.Connection,
    tenant_id: str,
    task_id: str,
    owner: str,
    status: TaskStatus,
    message: str | None,
) -> Task | None:
    row = await conn.fetchrow(Q["set_active_status"], tenant_id, task_id, owner, status.value, message)
    return _task_or_none(row)


async def claim_tasks(conn: asyncpg.Connection, owner: str, owner_key: int, lease_ms: int, limit: int) -> list[Task]:
    rows = await conn.fetch(Q["claim_tasks"], owner, owner_key, lease_ms, limit)
    return [task_from_row(r) for r in rows]


async def renew_leases(
    conn: asyncpg.Connection, owner: str, lease_ms: int, running: list[tuple[str, str]]
) -> set[tuple[str, str]]:
    tenants, task_ids = [k[0] for k in running], [k[1] for k in running]
    rows = await conn.fetch(Q["renew_leases"], owner, lease_ms, tenants, task_ids)
    return {(r["tenant_id"], r["task_id"]) for r in rows}


async def find_lost_leases(conn: asyncpg.Connection, limit: int) -> list[asyncpg.Record]:
    return list(await conn.fetch(Q["find_lost_leases"], limit))


async def requeue_task(conn: asyncpg.Connection, tenant_id: str, task_id: str, owner: str, message: str) -> Task | None:
    """Back to the queue; questions the previous run asked are voided with it."""
    task = _task_or_none(await conn.fetchrow(Q["requeue_task"], tenant_id, task_id, owner, message))
    if task is not None:
        await conn.execute(Q["void_unanswered_messages"], tenant_id, task_id)
    return task


async def fail_lost_task(
    conn: asyncpg.Connection, tenant_id: str, task_id: str, owner: str, error: dict[str, Any]
) -> Task | None:
    row = await conn.fetchrow(Q["fail_lost_task"], tenant_id, task_id, owner, error, error["message"])
    return _task_or_none(row)


async def count_active_by_status(conn: asyncpg.Connection) -> dict[str, int]:
    row = await conn.fetchrow(Q["count_active_by_status"])
    waiting = int(row["input_required"])
    return {"working": max(0, int(row["active"]) - waiting), "input_required": waiting}


async def delete_expired_tasks(conn: asyncpg.Connection, limit: int) -> list[Task]:
    return [task_from_row(r) for r in await conn.fetch(Q["delete_expired_tasks"], limit)]


async def lock_and_count_active(conn: asyncpg.Connection, principal: Principal) -> tuple[int, int]:
    """Take the tenant's create lock (until commit), then count (requestor, tenant) active tasks."""
    await conn.execute(Q["lock_tenant_creates"], principal.tenant_id)
    row = await conn.fetchrow(Q["count_active"], principal.tenant_id, principal.subject)
    return int(row["requestor"]), int(row["tenant"])


async def drop_idle_counters(conn: asyncpg.Connection) -> None:
    await conn.execute(Q["drop_idle_counters"])


# --- messages ---------------------------------------------------------------------------------


async def insert_message(
    conn: asyncpg.Connection, tenant_id: str, task_id: str, rpc_id: str, method: str, params: dict[str, Any]
) -> int:
    seq: int = await conn.fetchval(Q["insert_message"], tenant_id, task_id, rpc_id, method, params)
    return seq


async def claim_undelivered_messages(
    conn: asyncpg.Connection, tenant_id: str, task_id: str, stream_id: str, stale_ms: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(Q["claim_undelivered_messages"], tenant_id, task_id, stream_id, stale_ms))


async def unanswered_for_stream(conn: asyncpg.Connection, tenant_id: str, task_id: str, stream_id: str) -> list[str]:
    return [r["rpc_id"] for r in await conn.fetch(Q["unanswered_for_stream"], tenant_id, task_id, stream_id)]


async def touch_deliveries(conn: asyncpg.Connection, tenant_id: str, stream_id: str) -> None:
    await conn.execute(Q["touch_deliveries"], tenant_id, stream_id)


async def release_messages(conn: asyncpg.Connection, tenant_id: str, stream_id: str) -> None:
    await conn.execute(Q["release_messages"], tenant_id, stream_id)


async def answer_message(
    conn: asyncpg.Connection, principal: Principal, rpc_id: str, answer: dict[str, Any]
) -> asyncpg.Record | None:
    row: asyncpg.Record | None = await conn.fetchrow(
        Q["answer_message"], principal.tenant_id, rpc_id, answer, principal.subject
    )
    return row


async def get_answer(conn: asyncpg.Connection, tenant_id: str, task_id: str, seq: int) -> dict[str, Any] | None:
    answer: dict[str, Any] | None = await conn.fetchval(Q["get_answer"], tenant_id, task_id, seq)
    return answer


# --- sessions ---------------------------------------------------------------------------------


async def insert_session(
    conn: asyncpg.Connection,
    principal: Principal,
    session_id: str,
    protocol_version: str,
    client_capabilities: dict[str, Any],
    client_info: dict[str, Any] | None,
) -> None:
    await conn.execute(
        Q["insert_session"],
        principal.tenant_id,
        session_id,
        principal.subject,
        protocol_version,
        client_capabilities,
        client_info,
    )


async def get_session(conn: asyncpg.Connection, principal: Principal, session_id: str) -> asyncpg.Record | None:
    row: asyncpg.Record | None = await conn.fetchrow(
        Q["get_session"], principal.tenant_id, session_id, principal.subject
    )
    return row


async def touch_session(conn: asyncpg.Connection, tenant_id: str, session_id: str) -> None:
    await conn.execute(Q["touch_session"], tenant_id, session_id)


async def set_session_log_level(conn: asyncpg.Connection, tenant_id: str, session_id: str, level: str) -> None:
    await conn.execute(Q["set_session_log_level"], tenant_id, session_id, level)


async def delete_session(conn: asyncpg.Connection, principal: Principal, session_id: str) -> bool:
    row = await conn.fetchrow(Q["delete_session"], principal.tenant_id, session_id, principal.subject)
    return row is not None


async def delete_idle_sessions(conn: asyncpg.Connection, idle_ms: int) -> None:
    await conn.execute(Q["delete_idle_sessions"], idle_ms)


# --- audit ------------------------------------------------------------------------------------


async def audit_task_event(conn: asyncpg.Connection, task: Task, action: str, outcome: str, **detail: Any) -> None:
    """An audit event about a task, attributed to the task's own principal (runner-side changes)."""
    await append_audit(
        conn,
        task.tenant_id,
        action,
        outcome,
        subject=task.subject,
        client_id=task.client_id,
        issuer=task.issuer,
        task_id=task.task_id,
        detail=detail or None,
    )


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
    """Append to the tenant's hash chain inside the caller's transaction (migration 0003)."""
    await conn.execute(
        Q["append_audit"], tenant_id, action, outcome, subject, client_id, issuer, task_id, request_id, address, detail
    )


async def audit_events(
    conn: asyncpg.Connection, tenant_id: str | None, since: datetime | None, after: tuple[str, int], limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(Q["audit_events"], tenant_id, since, after[0], after[1], limit))


async def audit_chain_problems(conn: asyncpg.Connection, tenant_id: str | None) -> list[asyncpg.Record]:
    return list(await conn.fetch(Q["audit_chain_problems"], tenant_id))


# --- keys -------------------------------------------------------------------------------------


async def service_key(conn: asyncpg.Connection, name: str) -> bytes:
    """A 32-byte secret shared by every replica, created by whichever starts first."""
    await conn.execute(Q["ensure_key"], name, secrets.token_bytes(32))
    secret: bytes = await conn.fetchval(Q["get_key"], name)
    return secret
