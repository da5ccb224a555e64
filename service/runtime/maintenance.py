"""Maintenance loop: reap tasks of dead runners, delete expired tasks in batches, drop idle sessions."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from service.domain.errors import Unavailable
from service.observability import metrics
from service.store import repository as repo
from service.store.db import Database
from service.store.events import notify
from service.tools.execute import runner_stopped_error
from service.tools.registry import Registry

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
BATCH = 500


class Maintenance:
    def __init__(
        self,
        db: Database,
        registry: Registry,
        *,
        interval_s: float,
        session_idle_ms: int,
        pools: dict[str, Database] | None = None,
    ) -> None:
        self.db = db
        self.pools = pools or {"runner": db}
        self.registry = registry
        self.interval_s = interval_s
        self.session_idle_ms = session_idle_ms
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="maintenance")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            try:
                await self.run_once()
            except Unavailable as exc:
                log.warning("maintenance skipped: %s", exc)
            except Exception:
                log.exception("maintenance pass failed")
            await asyncio.sleep(self.interval_s)

    async def run_once(self) -> None:
        await self.reap_lost_leases()
        await self.delete_expired()
        await self.observe()
        async with self.db.connection() as conn:
            await repo.delete_idle_sessions(conn, self.session_idle_ms)
            await repo.drop_idle_counters(conn)

    async def observe(self) -> None:
        """Gauges read from the database and the pools (cluster-wide task counts; this process's pools)."""
        async with self.db.connection() as conn:
            counts = await repo.count_active_by_status(conn)
        for status in ("working", "input_required"):
            metrics.tasks_active.labels(status).set(counts.get(status, 0))
        for name, db in self.pools.items():
            in_use, size = db.pool_usage()
            metrics.db_pool_connections.labels(name, "in_use").set(in_use)
            metrics.db_pool_connections.labels(name, "idle").set(size - in_use)

    async def reap_lost_leases(self) -> int:
        count = 0
        async with self.db.transaction() as conn:
            # Lock order, the same as every other writer's: task rows and active-task counters in
            # (tenant, subject) order first, then audit heads in tenant order (no deadlock).
            lost = sorted(await repo.find_lost_leases(conn, BATCH), key=lambda r: (r["tenant_id"], r["subject"]))
            failed, moved_all = [], []
            for row in lost:
                tenant, task_id, owner = row["tenant_id"], row["task_id"], row["lease_owner"]
                spec = self.registry.tools.get(row["tool"])
                rerun = spec is not None and spec.rerunnable and row["attempts"] < MAX_ATTEMPTS
                metrics.lease_losses.labels("requeued" if rerun else "failed").inc()
                if rerun:
                    message = f"re-running: the previous runner stopped (attempt {row['attempts'] + 1})"
                    moved = await repo.requeue_task(conn, tenant, task_id, owner, message)
                else:
                    moved = await repo.fail_lost_task(conn, tenant, task_id, owner, runner_stopped_error(row["tool"]))
                    if moved is not None:
                        failed.append(moved)
                if moved is not None:
                    moved_all.append((moved, rerun))
            for task in sorted(failed, key=lambda t: t.tenant_id):
                await repo.audit_task_event(conn, task, "complete", "failed", reason="runner_stopped")
                metrics.tasks_finished.labels(task.tool, "failed", metrics.tenant(task.tenant_id)).inc()
            for task, rerun in moved_all:
                count += 1
                if rerun:
                    await notify(conn, {"k": "created", "t": task.tenant_id, "id": task.task_id})
                await notify(conn, {"k": "status", "t": task.tenant_id, "id": task.task_id, "s": task.session_id})
        if count:
            log.warning("reaped %d task(s) whose runner stopped", count)
        return count

    async def delete_expired(self) -> int:
        """D-12: an expired task is deleted whatever its state; its runner is told to stop."""
        total = 0
        while True:
            async with self.db.transaction() as conn:
                rows = await repo.delete_expired_tasks(conn, BATCH)
                for task in sorted(rows, key=lambda t: t.tenant_id):  # same lock order on every replica
                    await repo.audit_task_event(conn, task, "expire", task.status.value)
                    await notify(conn, {"k": "deleted", "t": task.tenant_id, "id": task.task_id})
            total += len(rows)
            metrics.sweeper_deleted.inc(len(rows))
            if len(rows) < BATCH:
                break
        return total
