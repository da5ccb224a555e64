"""The audit trail: denials recorded at the edge, and verification and export for reviewers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from service.domain.principal import RESERVED_TENANT, Caller
from service.store import repository as repo
from service.store.db import Database

log = logging.getLogger(__name__)

# Denials before a tenant is known (e.g. a bad token) go to this chain; no token may name it.
UNAUTHENTICATED_TENANT = RESERVED_TENANT
EXPORT_PAGE = 1_000


@dataclass(frozen=True, slots=True)
class ChainProblem:
    tenant_id: str
    seq: int
    problem: str


async def audit(
    conn: Any, caller: Caller, action: str, outcome: str, task_id: str | None = None, **detail: Any
) -> None:
    """Append one audit event for this caller inside the current transaction."""
    p = caller.principal
    await repo.append_audit(
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


class AuditLog:
    def __init__(self, db: Database, *, on_write_failure: Any = None) -> None:
        self.db = db
        self._on_write_failure = on_write_failure

    async def deny(
        self,
        caller: Caller | None,
        outcome: str,
        *,
        address: str | None = None,
        request_id: str | None = None,
        **detail: Any,
    ) -> None:
        """Record a refusal that changes nothing (bad token, rate limit). Never fails the request:
        a write failure is logged and counted instead."""
        tenant = caller.principal.tenant_id if caller else UNAUTHENTICATED_TENANT
        try:
            async with self.db.transaction(tenant) as conn:
                if caller is not None:
                    await audit(conn, caller, "deny", outcome, **detail)
                else:
                    await repo.append_audit(
                        conn, tenant, "deny", outcome, request_id=request_id, address=address, detail=detail or None
                    )
        except Exception as exc:
            log.error("audit write failed for a %s denial: %s", outcome, exc)
            if self._on_write_failure is not None:
                self._on_write_failure()

    async def verify(self, tenant_id: str | None = None) -> list[ChainProblem]:
        """Every break in the hash chains (all tenants unless one is named)."""
        async with self.db.transaction() as conn:
            rows = await repo.audit_chain_problems(conn, tenant_id)
        return [ChainProblem(r["tenant_id"], r["seq"], r["problem"]) for r in rows]

    async def export(self, tenant_id: str | None, since: datetime | None) -> AsyncIterator[dict[str, Any]]:
        """Events in chain order, as JSON-ready dicts, fetched a page at a time."""
        after: tuple[str, int] = ("", 0)
        while True:
            async with self.db.transaction() as conn:
                rows = await repo.audit_events(conn, tenant_id, since, after, EXPORT_PAGE)
            for row in rows:
                event = dict(row)
                event["at"] = row["at"].isoformat()
                yield event
            if len(rows) < EXPORT_PAGE:
                return
            after = (rows[-1]["tenant_id"], rows[-1]["seq"])
