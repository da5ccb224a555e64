"""The stored operations: named SQL in, domain objects out, one transaction per operation.

Nothing of asyncpg leaves this package: callers pass domain values and get domain values back.
Lifecycle metrics (created, finished, lease losses, expiries) are counted here, where the change
commits, and nowhere else.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from service.domain.inputs import InputKind, InputResponse, PendingInput, check_response
from service.domain.principal import Caller, Principal
from service.domain.task import Outcome, OutcomeKind, Task, TaskStatus
from service.domain.values import frozen
from service.observability import metrics
from service.store.db import Database
from service.store.events import InputAnswered, SessionChanged, TaskCancelRequested, TaskChanged, TaskDeleted, notify
from service.store.queries import Q
from service.store.requests import FinishRequest, ReleaseRequest, TaskRequest, as_items

# Stored values to their enums by a dict lookup (calling an enum class costs ten times as much;
# a row becomes a Task several times per lifecycle).
_STATUSES: dict[str, TaskStatus] = {status.value: status for status in TaskStatus}
_OUTCOMES: dict[str, OutcomeKind] = {kind.value: kind for kind in OutcomeKind}


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
        surface=row["surface"],
        rerunnable=row.get("rerunnable"),
        lease_epoch=row.get("lease_epoch") or 0,  # a runner's copy always has it (claims read every column)
    )


def _task_or_none(row: asyncpg.Record | None) -> Task | None:
    return task_from_row(row) if row is not None else None


def _matched(
    requests: Sequence[TaskRequest | FinishRequest | ReleaseRequest], rows: list[asyncpg.Record]
) -> list[Task | None]:
    """One task (or None) per request, checked to be the request's own: answers are handed out by
    position, so a row that is not its request's task fails the batch instead of reaching anyone.
    A create's task takes its arguments and capabilities from its request (not read back)."""
    tasks: list[Task | None] = []
    for request, row in zip(requests, rows, strict=True):  # a missing or extra row raises
        if row["task_id"] is None:
            tasks.append(None)
        elif (row["tenant_id"], row["task_id"]) != (request.tenant_id, request.task_id):
            raise RuntimeError("a batch returned a row for another request")
        elif isinstance(request, TaskRequest) and request.k == "create":
            tasks.append(task_from_row(row, request.arguments, request.client_capabilities))
        else:
            tasks.append(task_from_row(row))
    return tasks


def _finished(task: Task) -> None:
    kind = task.outcome.kind.value if task.outcome is not None else "cancelled"
    seconds = (task.last_updated_at - task.created_at).total_seconds()
    metrics.task_finished(task.tool, task.status.value, kind, task.tenant_id, seconds)


async def _audit(
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


async def _audit_caller(
    conn: asyncpg.Connection, caller: Caller, action: str, outcome: str, task_id: str | None = None, **detail: Any
) -> None:
    p = caller.principal
    await _audit(
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

    async def run(self, requests: list[TaskRequest]) -> list[Task | None]:
        """Creates and retrieves in one statement (its own transaction); None where there is no
        task for a request (a cap refused the create; the task is unknown, expired or not yours)."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["task_batch"], as_items(requests))
        tasks = _matched(requests, rows)
        for request, task in zip(requests, tasks, strict=True):
            if request.k == "create" and task is not None:
                metrics.task_created(task.tool, task.tenant_id)
        return tasks

    async def get_many(self, requests: list[TaskRequest]) -> list[Task | None]:
        """Gets in one statement: the task of each request, or None (unknown, expired or not the
        requestor's). Each row comes back with its request's place and is checked against it."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(
                Q["task_get_batch"],
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

    async def active_for(self, principal: Principal) -> int:
        """The requestor's active tasks, from the counters (a plain call's cap check)."""
        async with self.db.transaction(principal.tenant_id) as conn:
            row = await conn.fetchrow(Q["count_active"], principal.tenant_id, principal.subject)
        return int(row["requestor"])

    async def refuse_create(
        self, caller: Caller, tool: str, decide: Callable[[int, int], tuple[str, int, int]]
    ) -> tuple[str, int, int]:
        """A cap refused a create: under the tenant's create lock, count, let ``decide`` name the
        (scope, limit, current), and record the denial."""
        p = caller.principal
        async with self.db.transaction(p.tenant_id) as conn:
            await conn.execute(Q["lock_tenant_creates"], p.tenant_id)
            row = await conn.fetchrow(Q["count_active"], p.tenant_id, p.subject)
            scope, limit, current = decide(int(row["requestor"]), int(row["tenant"]))
            await _audit_caller(
                conn, caller, "deny", "cap_exceeded", scope=scope, limit=limit, current=current, tool=tool
            )
        return scope, limit, current

    async def deny(self, caller: Caller, outcome: str, task_id: str | None = None, **detail: Any) -> None:
        """Record a refusal that changed nothing."""
        async with self.db.transaction(caller.principal.tenant_id) as conn:
            await _audit_caller(conn, caller, "deny", outcome, task_id, **detail)

    async def deny_anonymous(self, tenant_id: str, outcome: str, *, request_id: str | None, address: str | None,
                             **detail: Any) -> None:  # fmt: skip
        async with self.db.transaction(tenant_id) as conn:
            await _audit(conn, tenant_id, "deny", outcome, request_id=request_id, address=address,
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
            task = _task_or_none(await conn.fetchrow(Q["cancel_task"], p.tenant_id, task_id, p.subject, message))
            if task is not None:
                await _audit_caller(conn, caller, "cancel", "cancelled", task_id)
                await notify(conn, TaskCancelRequested(p.tenant_id, task_id))
                await notify(conn, TaskChanged(p.tenant_id, task_id, task.session_id))
                existing = None
            else:
                existing = _task_or_none(await conn.fetchrow(Q["get_task"], p.tenant_id, task_id, p.subject))
                if existing is None:
                    await _audit_caller(conn, caller, "deny", "not_found", task_id[:200])
                else:
                    await _audit_caller(conn, caller, "cancel", f"refused:{existing.status.value}", task_id)
        if task is not None:
            _finished(task)
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
                await _audit_caller(conn, caller, "input", outcome, answered_task, key=key)
            session_id = await conn.fetchval(Q["resume_if_answered"], p.tenant_id, answered_task, remaining)
            await notify(conn, InputAnswered(p.tenant_id, answered_task))
            await notify(conn, TaskChanged(p.tenant_id, answered_task, session_id))
        return str(answered_task)


@frozen
class QueueStats:
    tool: str
    queued: int
    running: int
    oldest_queued_s: float
    oldest_running_s: float


@frozen
class LostLease:
    tenant_id: str
    task_id: str
    subject: str
    tool: str
    attempts: int
    owner: str
    rerunnable: bool | None  # as recorded at create (None: by a release that did not record it)
    epoch: int


@frozen
class LeaseState:
    status: TaskStatus
    owner: str | None
    epoch: int


class RunnerStore:
    """The runners' and the maintenance loop's operations (the runner role: all tenants)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def claim(
        self, owner: str, owner_key: int, task_lease_ms: int, limit: int, tools: Mapping[str, str | None], *,
        tenant_share: int, held: dict[str, int], running: Mapping[tuple[str, str], int] | None = None,
    ) -> list[Task]:  # fmt: skip
        """Up to ``limit`` queued tasks of the tools loaded here (``tools``: name → version, None if
        unversioned), round-robin over tenants and their subjects, none taking a tenant past
        ``tenant_share`` slots counting what it ``held`` here already, each subject's turns coming
        after the runs it has here (``running``: (tenant, subject) → runs); nothing once the
        owner's row lapsed. The tasks' own leases are ``task_lease_ms`` long."""
        versions = {name: version for name, version in tools.items() if version is not None}
        tenants, slots = list(held), list(held.values())
        runs = running or {}
        async with self.db.connection() as conn:  # one statement: its own transaction
            rows = await conn.fetch(
                Q["claim_tasks"], owner, owner_key, task_lease_ms, limit, list(tools), tenant_share, tenants,
                slots, versions, [t for t, _s in runs], [s for _t, s in runs], list(runs.values()),
            )  # fmt: skip
        return [task_from_row(r) for r in rows]

    async def publish(self, owner: str, owner_key: int, tools: dict[str, dict[str, Any]], live_ms: int) -> None:
        """This runner can run ``tools`` (name → {version, rerunnable}) for the next ``live_ms``."""
        async with self.db.connection() as conn:
            await conn.execute(Q["publish_runner"], owner, owner_key, tools, live_ms)

    async def withdraw(self, owner: str) -> None:
        async with self.db.connection() as conn:
            await conn.execute(Q["withdraw_runner"], owner)

    async def mark_without_runner(self) -> dict[str, int]:
        """Queued tasks whose tool no live runner has get a status message saying so (cleared
        once one has it); per queued tool, how many such tasks there are."""
        async with self.db.connection() as conn:
            await conn.execute(Q["delete_gone_runners"])
            rows = await conn.fetch(Q["mark_tasks_without_runner"])
        return {r["tool"]: int(r["without_runner"]) for r in rows}

    async def session_capabilities(self, tenant_id: str, session_id: str) -> dict[str, Any]:
        """What the client of a task's session declared; {} once the session has ended."""
        async with self.db.connection() as conn:
            caps = await conn.fetchval(Q["session_capabilities"], tenant_id, session_id)
        return caps if isinstance(caps, dict) else {}

    async def leased(self, tenant_id: str, task_id: str, owner: str) -> Task | None:
        """An active task leased to ``owner`` (after a create whose answer was lost)."""
        async with self.db.connection() as conn:
            return _task_or_none(await conn.fetchrow(Q["get_leased_task"], tenant_id, task_id, owner))

    async def renew(
        self, owner: str, lease_ms: int, due: list[tuple[tuple[str, str], int]], task_lease_ms: int
    ) -> tuple[bool, set[tuple[str, str]], set[tuple[str, str]]]:
        """The heartbeat: extend ``owner``'s row for ``lease_ms`` if it has not lapsed, and the
        tasks' own leases of the ``due`` runs (under their epochs) for ``task_lease_ms``. Whether
        the row was extended, the due keys renewed, and the due keys still ours whose rows were
        locked elsewhere and so not renewed (both empty when the row was not extended)."""
        tenants, task_ids, epochs = [k[0] for k, _ in due], [k[1] for k, _ in due], [e for _, e in due]
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["renew_leases"], owner, lease_ms, tenants, task_ids, epochs, task_lease_ms)
        held = {(r["tenant_id"], r["task_id"]) for r in rows if r["task_id"] is not None and not r["busy"]}
        busy = {(r["tenant_id"], r["task_id"]) for r in rows if r["busy"]}
        return any(r["task_id"] is None for r in rows), held, busy

    async def lease_state(self, tenant_id: str, task_id: str) -> LeaseState | None:
        """Where a task stands after a runner's write was refused (None: it is gone)."""
        async with self.db.connection() as conn:
            row = await conn.fetchrow(Q["lease_state"], tenant_id, task_id)
        if row is None:
            return None
        return LeaseState(TaskStatus(row["status"]), row["lease_owner"], row["lease_epoch"])

    async def finish(self, requests: list[FinishRequest]) -> list[Task | None]:
        """Outcomes (only where owner and epoch still hold the lease of an active task), their audit
        events and wake-ups, in one statement; None where the task was no longer theirs. The tasks
        come back without their payload, arguments and capabilities (the runner has them)."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["finish_task_batch"], as_items(requests))
        tasks = _matched(requests, rows)
        for task in tasks:
            if task is not None:
                _finished(task)
        return tasks

    async def release(self, requests: list[ReleaseRequest]) -> list[Task | None]:
        """Give tasks back: re-queued (rerunnable, attempts left) or failed; audited, woken."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["release_task_batch"], as_items(requests))
        tasks = _matched(requests, rows)
        for task in tasks:
            if task is None:
                continue
            requeued = task.status is TaskStatus.WORKING
            metrics.lease_losses.labels("requeued" if requeued else "failed").inc()
            if not requeued:
                _finished(task)
        return tasks

    async def ask(self, task: Task, owner: str, question: PendingInput) -> bool:
        """Store a question and go input_required, while the lease is ours (False: it is not)."""
        async with self.db.transaction() as conn:
            moved = await conn.fetchval(Q["ask_input"], task.tenant_id, task.task_id, owner, task.lease_epoch)
            if moved is None:
                return False
            await conn.execute(
                Q["insert_question"], task.tenant_id, task.task_id, question.key, question.kind.value, question.params
            )
            await notify(conn, TaskChanged(task.tenant_id, task.task_id, task.session_id))
        return True

    async def response(self, tenant_id: str, task_id: str, key: str) -> InputResponse | None:
        async with self.db.connection() as conn:
            stored = await conn.fetchval(Q["get_answer"], tenant_id, task_id, key)
        return InputResponse.from_stored(stored) if stored is not None else None

    async def lost_leases(self, limit: int) -> list[LostLease]:
        """Leases that lapsed, their own or their owner's row (not locked: the release re-checks
        owner, epoch and the lapse under the row lock)."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["find_lost_leases"], limit)
        return [LostLease(r["tenant_id"], r["task_id"], r["subject"], r["tool"], r["attempts"], r["lease_owner"],
                          r["rerunnable"], r["lease_epoch"])
                for r in rows]  # fmt: skip

    async def delete_expired(self, limit: int) -> int:
        """D-12: one batch of expired tasks deleted whatever their state, audited; their runners told."""
        async with self.db.transaction() as conn:
            tasks = [task_from_row(r) for r in await conn.fetch(Q["delete_expired_tasks"], limit)]
            for task in sorted(tasks, key=lambda t: t.tenant_id):  # same lock order on every replica
                await _audit(conn, task.tenant_id, "expire", task.status.value, subject=task.subject,
                             client_id=task.client_id, issuer=task.issuer, task_id=task.task_id)  # fmt: skip
                await notify(conn, TaskDeleted(task.tenant_id, task.task_id))
        metrics.sweeper_deleted.inc(len(tasks))
        return len(tasks)

    async def tidy(self, session_idle_ms: int, event_max_age_ms: int) -> None:
        """Idle sessions, requestors' zero counters and old event payloads go."""
        async with self.db.connection() as conn:
            await conn.execute(Q["delete_idle_sessions"], session_idle_ms)
            await conn.execute(Q["drop_idle_counters"])
            await conn.execute(Q["delete_old_event_payloads"], event_max_age_ms)

    async def analyze_stale(self, every: timedelta = timedelta(minutes=1)) -> list[str]:
        """ANALYZE the service's tables that changed enough since their last analysis, each at most
        once per ``every`` (what autovacuum would do when it is on); the names of those analysed."""
        async with self.db.connection() as conn:
            analysed = await conn.fetchval(Q["analyze_stale_tables"], every)
        return list(analysed or [])

    async def analyze_young(self) -> dict[str, tuple[bool, int]]:
        """ANALYZE the service's tables that have no statistics yet and in which 50 rows changed
        (whatever autovacuum does); every table still without statistics when called, with whether
        this call analysed it and how many of its rows changed."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["analyze_young_tables"])
        return {row["relname"]: (row["analysed"], row["changed"]) for row in rows}

    async def queue_by_tool(self) -> list[QueueStats]:
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["queue_by_tool"])
        return [QueueStats(r["tool"], r["queued"], r["running"], float(r["oldest_queued_s"]), float(r["oldest_running_s"]))
                for r in rows]  # fmt: skip

    async def active_by_tenant(self) -> dict[str, int]:
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["active_by_tenant"])
        return {r["tenant_id"]: int(r["active"]) for r in rows}

    async def active_by_status(self) -> dict[str, int]:
        async with self.db.connection() as conn:
            row = await conn.fetchrow(Q["count_active_by_status"])
        waiting = int(row["input_required"])
        return {"working": max(0, int(row["active"]) - waiting), "input_required": waiting}


@frozen
class StoredSession:
    session_id: str
    protocol_version: str
    client_capabilities: dict[str, Any]
    log_level: str | None
    last_seen_at: datetime


class SessionStore:
    """MCP sessions (2025-11-25), bound to the principal that opened them."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def insert(
        self,
        principal: Principal,
        session_id: str,
        protocol_version: str,
        client_capabilities: dict[str, Any],
        client_info: dict[str, Any] | None,
        *,
        keep: int,
    ) -> list[str]:
        """Store a new session; the principal's least recently used sessions beyond ``keep`` end
        in the same transaction, and their ids are returned."""
        async with self.db.transaction(principal.tenant_id) as conn:
            await conn.execute(
                Q["insert_session"], principal.tenant_id, session_id, principal.subject, protocol_version,
                client_capabilities, client_info,
            )  # fmt: skip
            rows = await conn.fetch(Q["trim_sessions"], principal.tenant_id, principal.subject, keep)
            for row in rows:
                await notify(conn, SessionChanged(principal.tenant_id, row["session_id"]))
        return [row["session_id"] for row in rows]

    async def get(self, principal: Principal, session_id: str, *, touch_after_s: float) -> StoredSession | None:
        """The session if it is the principal's; its last use is refreshed when older than ``touch_after_s``."""
        async with self.db.transaction(principal.tenant_id) as conn:
            row = await conn.fetchrow(Q["get_session"], principal.tenant_id, session_id, principal.subject)
            if row is None:
                return None
            if row["idle_s"] > touch_after_s:
                await conn.execute(Q["touch_session"], principal.tenant_id, session_id)
        return StoredSession(
            row["session_id"], row["protocol_version"], row["client_capabilities"], row["log_level"],
            row["last_seen_at"],
        )  # fmt: skip

    async def set_log_level(self, principal: Principal, session_id: str, level: str) -> None:
        async with self.db.transaction(principal.tenant_id) as conn:
            await conn.execute(Q["set_session_log_level"], principal.tenant_id, session_id, level)
            await notify(conn, SessionChanged(principal.tenant_id, session_id))

    async def delete(self, principal: Principal, session_id: str) -> bool:
        async with self.db.transaction(principal.tenant_id) as conn:
            row = await conn.fetchrow(Q["delete_session"], principal.tenant_id, session_id, principal.subject)
            if row is not None:
                await notify(conn, SessionChanged(principal.tenant_id, session_id))
        return row is not None


@frozen
class ChainProblem:
    tenant_id: str
    seq: int
    problem: str


class AuditStore:
    """Reading the audit trail: chain verification and export (any role that may read it)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def problems(self, tenant_id: str | None) -> list[ChainProblem]:
        async with self.db.transaction() as conn:
            rows = await conn.fetch(Q["audit_chain_problems"], tenant_id)
        return [ChainProblem(r["tenant_id"], r["seq"], r["problem"]) for r in rows]

    async def events(
        self, tenant_id: str | None, since: datetime | None, after: tuple[str, int], limit: int
    ) -> list[dict[str, Any]]:
        async with self.db.transaction() as conn:
            rows = await conn.fetch(Q["audit_events"], tenant_id, since, after[0], after[1], limit)
        return [dict(r) for r in rows]

    async def mark_exported(self, tenant_id: str, seq: int) -> None:
        """Events up to ``seq`` of the tenant's chain are written out: retention may purge them."""
        async with self.db.transaction() as conn:
            await conn.execute(Q["mark_audit_exported"], tenant_id, seq)

    async def purgeable_tenants(self) -> list[str]:
        async with self.db.transaction() as conn:
            return [r["tenant_id"] for r in await conn.fetch(Q["audit_purgeable_tenants"])]

    async def purge(self, tenant_id: str, before: datetime) -> int:
        """The tenant's exported events dated before ``before`` go (one transaction); how many."""
        async with self.db.transaction() as conn:
            removed: int = await conn.fetchval(Q["purge_audit"], tenant_id, before)
        return removed


async def service_key(db: Database, name: str) -> bytes:
    """A 32-byte secret shared by every replica, created by whichever starts first."""
    async with db.connection() as conn:
        await conn.execute(Q["ensure_key"], name, secrets.token_bytes(32))
        secret: bytes = await conn.fetchval(Q["get_key"], name)
    return secret
