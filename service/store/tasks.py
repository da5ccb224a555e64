"""Requests' operations on tasks (the app role: each transaction scoped to one tenant)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import datetime
from typing import Any

from service.domain.inputs import InputKind, InputResponse, PendingInput, check_response
from service.domain.principal import Caller, Principal
from service.domain.task import Task
from service.domain.values import frozen
from service.store.db import Database
from service.store.events import InputAnswered, TaskCancelRequested, TaskChanged, notify
from service.store.queries import Q
from service.store.requests import CreateRequest, GetRequest, RetrieveRequest, as_items
from service.store.rows import append_audit, append_audit_for, matched, task_from_row, task_or_none


@frozen
class CancelResult:
    """``task`` is the cancelled task; else ``existing`` is the task that was already terminal
    (both None: no such task for this principal)."""

    task: Task | None
    existing: Task | None


class TaskStore:
    """Requests' operations on tasks (the app role: each transaction scoped to one tenant)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, requests: list[CreateRequest]) -> list[Task | None]:
        """Creates in one statement (its own transaction); None where a cap refused one."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["task_create"], as_items(requests))
        return matched(requests, rows)

    async def get(self, requests: list[GetRequest]) -> list[Task | None]:
        """Gets in one statement: the task of each request, or None (unknown, expired or not the
        requestor's). Each row comes back with its request's place and is checked against it."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(
                Q["task_get"],
                [r.tenant_id for r in requests],
                [r.task_id for r in requests],
                [r.subject for r in requests],
            )
        tasks: list[Task | None] = [None] * len(requests)
        for row in rows:
            at = row["o"] - 1
            request = requests[at]
            if tasks[at] is not None or (row["tenant_id"], row["task_id"]) != (request.tenant_id, request.task_id):
                raise RuntimeError("a batch returned a row for another request")
            tasks[at] = task_from_row(row)
        return tasks

    async def retrieve(self, requests: list[RetrieveRequest]) -> list[Task | None]:
        """Retrieves in one statement, a finished task's hand-out audited; None where there is no
        task for the request (unknown, expired or not the requestor's)."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["task_retrieve"], as_items(requests))
        return matched(requests, rows)

    async def active_for(self, principal: Principal) -> int:
        """The requestor's active tasks, from the counters (a plain call's cap check)."""
        async with self.db.transaction(principal.tenant_id) as conn:
            row = await conn.fetchrow(Q["count_active"], principal.tenant_id, principal.subject)
        return int(row["requestor"])

    async def refuse_create(
        self, caller: Caller, tool: str, decide: Callable[[int, int, int], tuple[str, int, int]]
    ) -> tuple[str, int, int]:
        """A cap or the storage quota refused a create: under the tenant's create lock, count
        (active tasks of the requestor and of the tenant, the tenant's bytes kept), let ``decide``
        name the (scope, limit, current), and record the denial."""
        p = caller.principal
        async with self.db.transaction(p.tenant_id) as conn:
            await conn.execute(Q["lock_tenant_creates"], p.tenant_id)
            row = await conn.fetchrow(Q["count_held"], p.tenant_id, p.subject)
            scope, limit, current = decide(int(row["requestor"]), int(row["tenant"]), int(row["bytes"]))
            outcome = "quota_exceeded" if scope == "storage" else "cap_exceeded"
            await append_audit_for(conn, caller, "deny", outcome, scope=scope, limit=limit, current=current, tool=tool)
        return scope, limit, current

    async def deny(self, caller: Caller, outcome: str, task_id: str | None = None, **detail: Any) -> None:
        """Record a refusal that changed nothing."""
        async with self.db.transaction(caller.principal.tenant_id) as conn:
            await append_audit_for(conn, caller, "deny", outcome, task_id, **detail)

    async def deny_anonymous(self, tenant_id: str, outcome: str, *, request_id: str | None, address: str | None,
                             **detail: Any) -> None:  # fmt: skip
        async with self.db.transaction(tenant_id) as conn:
            await append_audit(conn, tenant_id, "deny", outcome, request_id=request_id, address=address,
                         detail=detail or None)  # fmt: skip

    async def list_tasks(self, principal: Principal, *, after: tuple[datetime, str] | None, limit: int) -> list[Task]:
        async with self.db.transaction(principal.tenant_id) as conn:
            if after is None:
                rows = await conn.fetch(Q["list_tasks_first"], principal.tenant_id, principal.subject, limit)
            else:
                rows = await conn.fetch(
                    Q["list_tasks_after"], principal.tenant_id, principal.subject, after[0], after[1], limit
                )
        return [task_from_row(r) for r in rows]

    async def cancel(self, caller: Caller, task_id: str, message: str) -> CancelResult:
        """Cancel wins: the row is cancelled (its lease dropped) and audited in one transaction."""
        p = caller.principal
        async with self.db.transaction(p.tenant_id) as conn:
            task = task_or_none(await conn.fetchrow(Q["cancel_task"], p.tenant_id, task_id, p.subject, message))
            if task is not None:
                await append_audit_for(conn, caller, "cancel", "cancelled", task_id)
                await notify(conn, TaskCancelRequested(p.tenant_id, task_id))
                await notify(conn, TaskChanged(p.tenant_id, task_id, task.session_id))
                existing = None
            else:
                existing = task_or_none(await conn.fetchrow(Q["get_task"], p.tenant_id, task_id, p.subject))
                if existing is None:
                    await append_audit_for(conn, caller, "deny", "not_found", task_id[:200])
                else:
                    await append_audit_for(conn, caller, "cancel", f"refused:{existing.status.value}", task_id)
        return CancelResult(task, existing)

    # --- questions and answers ------------------------------------------------------------------

    async def pending_inputs(self, principal: Principal, task_id: str) -> list[PendingInput]:
        """Every unanswered question of the principal's task, oldest first."""
        async with self.db.transaction(principal.tenant_id) as conn:
            rows = await conn.fetch(Q["pending_inputs"], principal.tenant_id, task_id, principal.subject)
        return [PendingInput(r["input_key"], InputKind(r["kind"]), r["params"]) for r in rows]

    async def claim_inputs(self, tenant_id: str, task_id: str, stream_id: str, stale_ms: int) -> list[PendingInput]:
        """Hand unanswered questions to one stream (no broadcast, H-MULTI-2); stale ones are offered again."""
        async with self.db.transaction(tenant_id) as conn:
            rows = await conn.fetch(Q["claim_undelivered_messages"], tenant_id, task_id, stream_id, stale_ms)
        return [PendingInput(r["input_key"], InputKind(r["kind"]), r["params"]) for r in rows]

    async def unanswered_for_stream(self, tenant_id: str, task_id: str, stream_id: str) -> list[str]:
        async with self.db.transaction(tenant_id) as conn:
            rows = await conn.fetch(Q["unanswered_for_stream"], tenant_id, task_id, stream_id)
        return [r["input_key"] for r in rows]

    async def touch_deliveries(self, tenant_id: str, stream_id: str) -> None:
        async with self.db.transaction(tenant_id) as conn:
            await conn.execute(Q["touch_deliveries"], tenant_id, stream_id)

    async def release_deliveries(self, tenant_id: str, stream_id: str) -> None:
        async with self.db.transaction(tenant_id) as conn:
            await conn.execute(Q["release_messages"], tenant_id, stream_id)

    async def answer(self, caller: Caller, task_id: str | None, responses: dict[str, InputResponse]) -> str | None:
        """Apply answers atomically: only keys still outstanding on the caller's active task count
        (others are ignored), every one of those must parse as its question's answer or nothing is
        applied (InvalidArguments), the first answer per key wins, and when no question remains the
        task is working again. ``task_id`` None: find the task by the keys (2025-11-25 answers by
        request id). Returns the task answered, or None when no key was outstanding."""
        p = caller.principal
        async with self.db.transaction(p.tenant_id) as conn:
            if task_id is None:
                task_id = await conn.fetchval(Q["task_of_input"], p.tenant_id, list(responses))
                if task_id is None:
                    return None
            if await conn.fetchval(Q["lock_task_for_answers"], p.tenant_id, task_id, p.subject) is None:
                return None
            rows = await conn.fetch(Q["lock_outstanding_inputs"], p.tenant_id, p.subject, task_id, list(responses))
            if not rows:
                return None
            answered_task = rows[0]["task_id"]
            rows = [r for r in rows if r["task_id"] == answered_task]  # keys of one task per call
            for row in rows:
                check_response(InputKind(row["kind"]), responses[row["input_key"]])
            keys = [r["input_key"] for r in rows]
            answers = [responses[k].to_stored() for k in keys]
            remaining = await conn.fetchval(Q["store_answers"], p.tenant_id, answered_task, keys, answers)
            for key in keys:
                response = responses[key]
                result = response.result or {}
                action = result.get("action")
                # Only known words reach the audit trail: the client chooses this value.
                outcome = "error" if response.error is not None else action if action in (
                    "accept", "decline", "cancel") else "answered"  # fmt: skip
                await append_audit_for(conn, caller, "input", outcome, answered_task, key=key)
            session_id = await conn.fetchval(Q["resume_if_answered"], p.tenant_id, answered_task, remaining)
            await notify(conn, InputAnswered(p.tenant_id, answered_task))
            await notify(conn, TaskChanged(p.tenant_id, answered_task, session_id))
        return str(answered_task)


async def service_key(db: Database, name: str) -> bytes:
    """A 32-byte secret shared by every replica, created by whichever starts first."""
    async with db.connection() as conn:
        await conn.execute(Q["ensure_key"], name, secrets.token_bytes(32))
        secret: bytes = await conn.fetchval(Q["get_key"], name)
    return secret
