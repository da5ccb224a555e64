"""Reading the audit trail: chain verification, export and retention."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from service.domain.values import frozen
from service.store.db import Database
from service.store.queries import Q


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
