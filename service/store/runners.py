"""The runners' and the maintenance pass's operations (the runner role: all tenants)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from service.domain.inputs import InputResponse, PendingInput
from service.domain.task import Task, TaskStatus
from service.domain.values import frozen
from service.store.db import Database
from service.store.events import TaskChanged, TaskDeleted, notify
from service.store.queries import Q
from service.store.requests import FinishRequest, HandBackRequest, as_items
from service.store.rows import append_audit, matched, task_from_row, task_or_none


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
    rerunnable: bool  # as recorded at create
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
        self, owner: str, task_lease_ms: int, limit: int, tools: Mapping[str, str | None], *,
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
                Q["claim_tasks"], owner, task_lease_ms, limit, list(tools), tenant_share, tenants,
                slots, versions, [t for t, _s in runs], [s for _t, s in runs], list(runs.values()),
            )  # fmt: skip
        return [task_from_row(r) for r in rows]

    async def publish(self, owner: str, tools: dict[str, dict[str, Any]], live_ms: int) -> None:
        """This runner can run ``tools`` (name → {version, rerunnable}) for the next ``live_ms``."""
        async with self.db.connection() as conn:
            await conn.execute(Q["publish_runner"], owner, tools, live_ms)

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
            return task_or_none(await conn.fetchrow(Q["get_leased_task"], tenant_id, task_id, owner))

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
            rows = await conn.fetch(Q["task_finish"], as_items(requests))
        return matched(requests, rows)

    async def hand_back(self, requests: list[HandBackRequest]) -> list[Task | None]:
        """Give tasks back: re-queued (rerunnable, attempts left) or failed; audited, woken."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["task_hand_back"], as_items(requests))
        return matched(requests, rows)

    async def remember(self, task: Task, owner: str, note: dict[str, Any]) -> bool:
        """Keep the run's note for a run after a takeover, while the lease is ours (False: it is not)."""
        async with self.db.connection() as conn:
            done = await conn.fetchval(Q["remember_note"], task.tenant_id, task.task_id, owner, task.lease_epoch, note)
        return done is not None

    async def recall(self, tenant_id: str, task_id: str) -> dict[str, Any] | None:
        async with self.db.connection() as conn:
            note: dict[str, Any] | None = await conn.fetchval(Q["recall_note"], tenant_id, task_id)
        return note

    async def noted(self, keys: list[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which of these (tenant, task) have a note."""
        if not keys:
            return set()
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["noted_tasks"], [k[0] for k in keys], [k[1] for k in keys])
        return {(r["tenant_id"], r["task_id"]) for r in rows}

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

    async def note_progress(self, task: Task, owner: str, text: str) -> bool:
        """The task's status message is ``text`` (its latest progress) while the lease is ours;
        watchers are woken. False: it is not working under our lease any more."""
        async with self.db.transaction() as conn:
            row = await conn.fetchrow(Q["note_progress"], task.tenant_id, task.task_id, owner, task.lease_epoch, text)
            if row is None:
                return False
            await notify(conn, TaskChanged(task.tenant_id, task.task_id, row["session_id"]))
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
        """D-12: one batch of expired tasks deleted (ended, or waiting a TTL), audited; their runners told."""
        async with self.db.transaction() as conn:
            tasks = [task_from_row(r) for r in await conn.fetch(Q["delete_expired_tasks"], limit)]
            for task in sorted(tasks, key=lambda t: t.tenant_id):  # same lock order on every replica
                await append_audit(conn, task.tenant_id, "expire", task.status.value, subject=task.subject,
                                   client_id=task.client_id, issuer=task.issuer, task_id=task.task_id)  # fmt: skip
                await notify(conn, TaskDeleted(task.tenant_id, task.task_id))
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

    async def held_by_tenant(self) -> dict[str, tuple[int, int]]:
        """Per tenant: its active tasks and the bytes its tasks keep."""
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["active_by_tenant"])
        return {r["tenant_id"]: (int(r["active"]), int(r["bytes"])) for r in rows}

    async def active_by_status(self) -> tuple[dict[str, int], int]:
        """Active tasks by status, and the bytes every tenant's tasks keep."""
        async with self.db.connection() as conn:
            row = await conn.fetchrow(Q["count_active_by_status"])
        waiting = int(row["input_required"])
        return {"working": max(0, int(row["active"]) - waiting), "input_required": waiting}, int(row["bytes"])
