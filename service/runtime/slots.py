"""The slot book: what each tenant holds of one process's runner slots, kept as counts."""

from __future__ import annotations

from collections import Counter


class _Tally:
    """Counts per tenant and their total; a tenant whose count falls to zero leaves the table."""

    __slots__ = ("by_tenant", "total")

    def __init__(self) -> None:
        self.by_tenant: Counter[str] = Counter()
        self.total = 0

    def add(self, tenant_id: str, n: int) -> None:
        self.total += n
        self.by_tenant[tenant_id] += n
        if self.by_tenant[tenant_id] <= 0:
            del self.by_tenant[tenant_id]


class Slots:
    """Tools running, creates promised a slot (reservations) and outcome writes under way, per
    tenant. A tenant holds its running tools, its reservations, and its outcome writes beyond its
    share (so a tenant whose writes back up cannot, by starting ever more tools, fill the
    process's bound on runs in memory); writes beyond ``concurrency`` waiting at once count as
    slots in use again (a database that records slower than tools end cannot pile up runs)."""

    def __init__(self, concurrency: int, tenant_share: int) -> None:
        self.concurrency = concurrency
        self.tenant_share = tenant_share
        self.running = _Tally()
        self.reserved = _Tally()
        self.recording = _Tally()
        # Runs waiting for an answer with their slot given back: at most a share per tenant and
        # ``concurrency`` in all, so what waits in memory stays bounded (issue 42 §3).
        self.waiting = _Tally()

    def may_wait(self, tenant_id: str) -> bool:
        """Whether one more run of the tenant may wait without its slot."""
        return self.waiting.by_tenant[tenant_id] < self.tenant_share and self.waiting.total < self.concurrency

    @property
    def busy(self) -> int:
        return self.running.total + max(0, self.recording.total - self.concurrency)

    def held_by(self, tenant_id: str) -> int:
        return (
            self.running.by_tenant[tenant_id]
            + self.reserved.by_tenant[tenant_id]
            + max(0, self.recording.by_tenant[tenant_id] - self.tenant_share)
        )

    def held(self) -> dict[str, int]:
        tenants = {*self.running.by_tenant, *self.reserved.by_tenant, *self.recording.by_tenant}
        return {tenant: n for tenant in sorted(tenants) if (n := self.held_by(tenant))}
