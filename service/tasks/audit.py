"""The audit trail: denials recorded at the edge, and verification and export for reviewers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any

from service.domain.principal import RESERVED_TENANT, Caller
from service.store.audit import AuditStore, ChainProblem
from service.store.db import Database
from service.store.tasks import TaskStore

log = logging.getLogger(__name__)

# Denials before a tenant is known (e.g. a bad token) go to this chain; no token may name it.
UNAUTHENTICATED_TENANT = RESERVED_TENANT
EXPORT_PAGE = 1_000

__all__ = ["UNAUTHENTICATED_TENANT", "AuditLog", "ChainProblem"]


class AuditLog:
    def __init__(self, db: Database, *, on_write_failure: Callable[[], None] | None = None) -> None:
        self._tasks = TaskStore(db)
        self._audit = AuditStore(db)
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
        try:
            if caller is not None:
                await self._tasks.deny(caller, outcome, **detail)
            else:
                await self._tasks.deny_anonymous(
                    UNAUTHENTICATED_TENANT, outcome, request_id=request_id, address=address, **detail
                )
        except Exception as exc:
            log.error("audit write failed for a %s denial: %s", outcome, exc)
            if self._on_write_failure is not None:
                self._on_write_failure()

    async def verify(self, tenant_id: str | None = None) -> list[ChainProblem]:
        """Every break in the hash chains (all tenants unless one is named)."""
        return await self._audit.problems(tenant_id)

    async def export(
        self, tenant_id: str | None, since: datetime | None, *, written: dict[str, int] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Events in chain order, as JSON-ready dicts, fetched a page at a time. ``written`` gets
        each tenant's last seq handed out (for ``mark_exported`` once they are safely stored)."""
        after: tuple[str, int] = ("", 0)
        while True:
            rows = await self._audit.events(tenant_id, since, after, EXPORT_PAGE)
            for event in rows:
                yield {**event, "at": event["at"].isoformat()}
                if written is not None:
                    written[event["tenant_id"]] = event["seq"]
            if len(rows) < EXPORT_PAGE:
                return
            after = (rows[-1]["tenant_id"], rows[-1]["seq"])

    async def mark_exported(self, written: dict[str, int]) -> None:
        """Record how far each tenant's chain was written out from its first remaining row."""
        for tenant_id, seq in sorted(written.items()):
            await self._audit.mark_exported(tenant_id, seq)

    async def purge(self, before: datetime, tenants: list[str] | None = None) -> dict[str, int]:
        """Retention: every tenant's (or the named ones') exported events dated before ``before``
        go; the chain keeps a checkpoint and records the purge. Rows removed per tenant."""
        removed: dict[str, int] = {}
        for tenant_id in tenants if tenants is not None else await self._audit.purgeable_tenants():
            if n := await self._audit.purge(tenant_id, before):
                removed[tenant_id] = n
        return removed
