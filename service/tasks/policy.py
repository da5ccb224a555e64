"""What the use cases are bound by (TaskPolicy), and how a refused create says which bound it met."""

from __future__ import annotations

from collections.abc import Callable

from service.domain.errors import CapacityExceeded, StorageQuotaExceeded
from service.domain.values import frozen


@frozen
class TaskPolicy:
    default_ttl_ms: int
    min_ttl_ms: int
    max_ttl_ms: int
    poll_interval_ms: int
    max_active_per_requestor: int = 16
    max_active_per_tenant: int = 256
    # The bytes a tenant's tasks may keep (arguments and results, issue 42 §6); None: no quota.
    tenant_storage_quota_bytes: int | None = None
    # A question handed to a stream that went away without releasing it (replica crash) is
    # offered to the next stream after this.
    stale_delivery_ms: int = 60_000


def refusal_scope(policy: TaskPolicy, *, plain: int, size: int) -> Callable[[int, int, int], tuple[str, int, int]]:
    """Which bound refused a create of ``size`` bytes (0: a plain call), from the counts under the
    tenant's create lock (the requestor's active tasks, the tenant's, the tenant's bytes kept) and
    the requestor's ``plain`` calls running here: (scope, limit, current). A create under both caps
    was refused by the storage quota."""
    quota = policy.tenant_storage_quota_bytes

    def decide(mine: int, tenant: int, held: int) -> tuple[str, int, int]:
        mine += plain
        under_caps = mine < policy.max_active_per_requestor and tenant < policy.max_active_per_tenant
        if quota is not None and size and under_caps:
            return "storage", quota, held
        if tenant >= policy.max_active_per_tenant and mine < policy.max_active_per_requestor:
            return "tenant", policy.max_active_per_tenant, tenant
        return "requestor", policy.max_active_per_requestor, mine

    return decide


def capacity_error(scope: str, limit: int, current: int) -> CapacityExceeded:
    """The refusal a client gets: the storage quota's own error, or a cap's."""
    if scope == "storage":
        return StorageQuotaExceeded(
            f"this tenant's tasks keep {current} bytes of arguments and results, and this call's would pass "
            f"its storage quota of {limit} bytes; wait for finished tasks to expire (a shorter ttl frees space "
            "sooner), or send smaller arguments, and try again",
            scope=scope, limit=limit, current=current,
        )  # fmt: skip
    return CapacityExceeded(
        f"too many active tasks for this {scope}: {current} of at most {limit}; "
        "wait for one to finish (or cancel one) and try again",
        scope=scope, limit=limit, current=current,
    )  # fmt: skip
