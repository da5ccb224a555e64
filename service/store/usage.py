"""Reading the audit record for operators: usage per tenant (``mcp-tasks usage``) and the trail of
one task or one subject (``mcp-tasks audit trail``); the plain calls that usage counts beside the
record. Queries: ``sql/usage.sql``, ``sql/audit_trail.sql``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from service.store.db import Database
from service.store.queries import Q


@dataclass(frozen=True)
class Usage:
    """One tenant's (and tool's) tasks in a time range: created in it, and ended in it by how; and its
    plain calls in the hours the range touches."""

    tenant_id: str
    tool: str
    created: int
    completed: int
    failed: int
    cancelled: int
    expired: int
    task_seconds: float
    plain_calls: int


class UsageStore:
    """Across tenants: connect as the runner role (``mcp-tasks usage`` is the operator's report)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def report(self, tenant_id: str | None, since: datetime | None, until: datetime | None) -> list[Usage]:
        async with self.db.transaction() as conn:
            rows = await conn.fetch(Q["usage_report"], tenant_id, since, until)
        return [
            Usage(r["tenant_id"], r["tool"], r["created"], r["completed"], r["failed"], r["cancelled"], r["expired"],
                  r["task_seconds"], r["plain_calls"])
            for r in rows
        ]  # fmt: skip


class PlainCallTally:
    """Plain calls (answered inside their request, never a task) counted in memory per tenant, tool
    and hour (UTC), and added to ``usage_plain_calls`` by ``flush`` (each maintenance pass, and at
    shutdown): a row per call would cost more than the call. Counts a flush could not write stay
    for the next one."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str, datetime]] = Counter()

    def count(self, tenant_id: str, tool: str) -> None:
        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        self._counts[(tenant_id, tool, hour)] += 1

    async def flush(self, db: Database) -> int:
        """Add the counts so far (``db``: a pool of the runner role); returns the calls written."""
        taken, self._counts = self._counts, Counter()
        if not taken:
            return 0
        keys = sorted(taken)
        try:
            async with db.transaction() as conn:
                await conn.execute(
                    Q["usage_add_plain_calls"], [k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys],
                    [taken[k] for k in keys],
                )  # fmt: skip
        except BaseException:
            self._counts.update(taken)
            raise
        return sum(taken.values())


class AuditTrailStore:
    """One tenant's rows: each read runs as the app role with that tenant set (row-level security),
    so ``db`` must be a pool of ``mcp_tasks_app``. The tenant lookups need ``lookup``, a pool of
    ``mcp_tasks_runner`` (they name tenants only, never return their rows)."""

    def __init__(self, db: Database, lookup: Database | None = None) -> None:
        self.db = db
        self.lookup = lookup

    async def of_task(self, tenant_id: str, task_id: str) -> list[dict[str, Any]]:
        async with self.db.transaction(tenant_id) as conn:
            return [dict(r) for r in await conn.fetch(Q["audit_trail_of_task"], tenant_id, task_id)]

    async def of_subject(
        self, tenant_id: str, subject: str, since: datetime, until: datetime | None
    ) -> list[dict[str, Any]]:
        async with self.db.transaction(tenant_id) as conn:
            return [dict(r) for r in await conn.fetch(Q["audit_trail_of_subject"], tenant_id, subject, since, until)]

    async def tenants_creating(self, task_id: str) -> list[str]:
        assert self.lookup is not None
        async with self.lookup.transaction() as conn:
            return [r["tenant_id"] for r in await conn.fetch(Q["audit_tenant_creating_task"], task_id)]

    async def tenants_of_subject(self, subject: str, since: datetime) -> list[str]:
        assert self.lookup is not None
        async with self.lookup.transaction() as conn:
            return [r["tenant_id"] for r in await conn.fetch(Q["audit_tenants_of_subject"], subject, since)]
