"""Maintenance loop: reap tasks of dead runners, delete expired tasks in batches, drop idle sessions,
purge exported audit events past their retention, write the plain calls counted since the last
pass, give a new deployment's tables their first statistics at once, and keep the planner's
statistics when the server's autovacuum does not."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime, timedelta

from service.concurrency.stopping import cancel_and_wait
from service.domain.errors import Unavailable
from service.observability import metrics
from service.runtime.handback import count_handed_back, hand_back
from service.store.audit import AuditStore
from service.store.db import Database
from service.store.runners import RunnerStore
from service.store.usage import PlainCallTally
from service.tools.registry import Registry

log = logging.getLogger(__name__)

BATCH = 500
# Events sent by reference are read at once by every listener; their payloads go after this.
EVENT_PAYLOAD_MAX_AGE_MS = 60_000
# Retention deletes in bulk: once in this many seconds is plenty (the first pass runs at start).
AUDIT_PURGE_EVERY_S = 600.0
# Until tasks has its first statistics, between passes the young tables are looked at this often
# while its rows change; each look that finds no more changed doubles the wait, up to a second (an
# idle new deployment is not asked four times a second, and its first burst is still seen at once).
YOUNG_POLL_S = 0.25
YOUNG_IDLE_POLL_S = 1.0
# Stopping lets the statement in flight finish (cut, asyncpg would send PostgreSQL a cancel request
# over a connection of its own, left behind if the loop ends first); a pass still running after
# this long is cancelled.
STOP_GRACE_S = 5.0


class Maintenance:
    def __init__(
        self,
        db: Database,
        registry: Registry,
        *,
        interval_s: float,
        session_idle_ms: int,
        pools: dict[str, Database] | None = None,
        audit_retention_days: int | None = None,
        analyze: bool = False,
        plain_calls: PlainCallTally | None = None,
    ) -> None:
        """``analyze``: the server's autovacuum is off, so each pass analyses the tables that
        changed enough (without statistics the planner may read every task of a tenant to find
        one: docs/decisions.md, "Statistics when autovacuum is off")."""
        self.store = RunnerStore(db)
        self.audit = AuditStore(db)
        self.audit_retention_days = audit_retention_days
        self.analyze = analyze
        self.plain_calls = plain_calls
        self._audit_purged_at: float | None = None
        self.pools = pools or {"runner": db}
        self.registry = registry
        self.interval_s = interval_s
        self.session_idle_ms = session_idle_ms
        self._task: asyncio.Task[None] | None = None
        self._tools_seen: set[str] = set()
        self._tenants_seen: set[str] = set()
        self._stranded: set[str] = set()  # tools with tasks no live runner can run, as of the last pass
        self._young = True  # until tasks has statistics
        self._young_changed = 0  # its rows changed, as of the last look
        self._young_wait_s = YOUNG_POLL_S
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="maintenance")

    async def stop(self) -> None:
        """The loop ends at its next wait; a pass still running after STOP_GRACE_S is cancelled."""
        if self._task is None:
            return
        self._stopping.set()
        _done, running = await asyncio.wait({self._task}, timeout=STOP_GRACE_S)
        await cancel_and_wait(*running)
        if not self._task.cancelled():
            self._task.exception()  # collected: a failure of the loop itself was logged by it
        try:  # the plain calls answered since the last pass
            await self.flush_plain_calls()
        except Exception as exc:
            log.warning("the plain calls counted since the last maintenance pass are lost: %s", exc)

    async def _pause(self, seconds: float) -> bool:
        """Wait ``seconds``, or less if the loop is stopping; is it?"""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.run_once()
            except Unavailable as exc:
                log.warning("maintenance skipped: %s", exc)
            except Exception:
                log.exception("maintenance pass failed")
            next_pass = time.monotonic() + self.interval_s
            while self._young and next_pass - time.monotonic() > self._young_wait_s:
                if await self._pause(self._young_wait_s):
                    return
                try:
                    await self.analyze_young()
                except Exception:  # the next pass reports it (an outage, say) and tries again
                    break
            if await self._pause(max(0.0, next_pass - time.monotonic())):
                return

    async def run_once(self) -> None:
        await self.flush_plain_calls()
        await self.reap_lost_leases()
        await self.delete_expired()
        await self.flag_tasks_without_runner()
        await self.observe()
        await self.store.tidy(self.session_idle_ms, EVENT_PAYLOAD_MAX_AGE_MS)
        now = time.monotonic()
        if self._audit_purged_at is None or now - self._audit_purged_at >= AUDIT_PURGE_EVERY_S:
            self._audit_purged_at = now
            await self.purge_audit()
        # Last: the pass's own statements ran on the statistics it found.
        if self._young:
            try:
                await self.analyze_young()
            except Unavailable:
                raise
            except Exception:  # not a reason to skip the analyses autovacuum would do
                log.exception("the first analysis of the service's tables failed")
        if self.analyze:
            await self.analyze_stale()

    async def flush_plain_calls(self) -> int:
        """Usage: the plain calls this process answered since the last pass, added to usage_plain_calls."""
        return 0 if self.plain_calls is None else await self.plain_calls.flush(self.pools["runner"])

    async def analyze_young(self) -> list[str]:
        """A new deployment's first statistics, autovacuum or not: until its first
        ANALYZE a lookup of one task may walk every task of its tenant, and the plans cached
        meanwhile stay. Called between passes too, until tasks has been analysed: every 0.25 s
        while its rows change, the wait doubling (up to a second) while none do."""
        young = await self.store.analyze_young()
        analysed = sorted(name for name, (done, _) in young.items() if done)
        if analysed:
            log.info("analysed %s (their first statistics)", ", ".join(analysed))
        done, changed = young.get("tasks", (True, 0))
        self._young = not done
        if changed > self._young_changed:
            self._young_wait_s = YOUNG_POLL_S
        else:
            self._young_wait_s = min(2 * self._young_wait_s, YOUNG_IDLE_POLL_S)
        self._young_changed = changed
        return analysed

    async def analyze_stale(self) -> list[str]:
        """What autovacuum's analyses would do, for the service's tables (one process at a time)."""
        analysed = await self.store.analyze_stale()
        if analysed:
            log.info("analysed %s (the server's autovacuum is off)", ", ".join(analysed))
        return analysed

    async def purge_audit(self) -> int:
        """Retention (issue 14, finding 7): audit events older than the retention go, but only those
        ``mcp-tasks audit export`` has written out; each purge leaves a checkpoint and a ``purge`` event."""
        if self.audit_retention_days is None:
            return 0
        before = datetime.now(UTC) - timedelta(days=self.audit_retention_days)
        total = 0
        for tenant_id in await self.audit.purgeable_tenants():
            if removed := await self.audit.purge(tenant_id, before):
                log.info("purged %d exported audit event(s) of a tenant older than %d days", removed,
                         self.audit_retention_days)  # fmt: skip
                total += removed
        return total

    async def flag_tasks_without_runner(self) -> None:
        """Issue 13, point 3: a queued task whose tool no live runner has stays queued, says so in
        its status message, and is counted per tool (mcp_tasks_tasks_without_runner)."""
        by_tool = await self.store.mark_without_runner()
        # Every tool loaded here or seen before reads 0 when none of its tasks waits for a runner.
        for tool in set(self.registry.tools) | self._tools_seen | set(by_tool):
            metrics.tasks_without_runner.labels(tool).set(by_tool.get(tool, 0))
        stranded = {tool for tool, n in by_tool.items() if n}
        for tool in sorted(stranded - self._stranded):  # once when it starts, not once per pass
            log.warning("tasks of tool %r are queued and no live runner has that tool; start a worker with its pack",
                        tool)  # fmt: skip
        self._stranded = stranded

    async def observe(self) -> None:
        """Gauges read from the database and the pools (cluster-wide task counts; this process's pools)."""
        counts, stored = await self.store.active_by_status()
        for status in ("working", "input_required"):
            metrics.tasks_active.labels(status).set(counts.get(status, 0))
        metrics.storage_bytes.set(stored)
        # Per tool: a tool seen before and gone now reads 0, not its last value.
        by_tool = {q.tool: q for q in await self.store.queue_by_tool()}
        for tool in self._tools_seen | set(by_tool):
            q = by_tool.get(tool)
            metrics.tasks_queued.labels(tool).set(q.queued if q else 0)
            metrics.tasks_running.labels(tool).set(q.running if q else 0)
            metrics.oldest_queued_seconds.labels(tool).set(q.oldest_queued_s if q else 0)
            metrics.oldest_running_seconds.labels(tool).set(q.oldest_running_s if q else 0)
        self._tools_seen |= set(by_tool)
        if metrics.tenant_label_on():
            by_tenant = await self.store.held_by_tenant()
            for tenant_id in self._tenants_seen | set(by_tenant):
                active, kept = by_tenant.get(tenant_id, (0, 0))
                metrics.tenant_tasks_active.labels(metrics.tenant(tenant_id)).set(active)
                metrics.tenant_storage_bytes.labels(metrics.tenant(tenant_id)).set(kept)
            self._tenants_seen |= set(by_tenant)
        for name, db in self.pools.items():
            in_use, size = db.pool_usage()
            metrics.db_pool_connections.labels(name, "in_use").set(in_use)
            metrics.db_pool_connections.labels(name, "idle").set(size - in_use)

    async def reap_lost_leases(self) -> int:
        """Tasks whose lease ran out go back (re-run) or fail, as on shutdown. Only a lapsed lease:
        its runner has stopped their tools by then, or died (docs/decisions.md, "Fencing")."""
        lost = await self.store.lost_leases(BATCH)
        if not lost:
            return 0
        requests = sorted(
            (
                hand_back(tenant_id=t.tenant_id, task_id=t.task_id, subject=t.subject, tool=t.tool, owner=t.owner,
                          epoch=t.epoch, why="re-running: the previous runner stopped", rerunnable=t.rerunnable,
                          only_if_lapsed=True)
                for t in lost
            ),
            key=lambda r: r.order,
        )  # fmt: skip
        moved = count_handed_back(await self.store.hand_back(requests))
        if moved:
            log.warning("reaped %d task(s) whose runner stopped", moved)
        return moved

    async def delete_expired(self) -> int:
        """D-12: expired tasks (ended, or waiting for input or for a runner, a TTL ago) are deleted;
        a runner whose task waited for input is told to stop."""
        total = 0
        while True:
            deleted = await self.store.delete_expired(BATCH)
            metrics.sweeper_deleted.inc(deleted)
            total += deleted
            if deleted < BATCH:
                return total
