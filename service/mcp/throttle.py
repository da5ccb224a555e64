"""The third layer: the principal's rate limit (slowapi's limits, shared storage), and the tenant's
share of what this process holds in flight (requests, and the streams and subscriptions that are
requests held open)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from starlette.datastructures import Headers

from service.domain.principal import Caller
from service.guard.ratelimit import RateLimited, RateLimiter
from service.mcp import v2026_wire as v2026
from service.mcp.jsonrpc import RATE_LIMITED
from service.mcp.refusal import Refusal
from service.observability import metrics
from service.tasks.audit import AuditLog

VERSION_HEADER = "mcp-protocol-version"


def throttled(limited: RateLimited, headers: Headers, extra: dict[str, str] | None = None) -> Refusal:
    """HTTP 429 with Retry-After and a JSON-RPC error body: on 2025-11-25 a code of the server-defined
    range, on 2026-07-28 our application code (X-ERR-2)."""
    metrics.rate_limited.labels(limited.scope).inc()
    code = v2026.RATE_LIMITED if headers.get(VERSION_HEADER) == v2026.VERSION else RATE_LIMITED
    return Refusal(
        code, limited.message, status=429, headers={"Retry-After": str(limited.retry_after_s), **(extra or {})}
    )


class Throttle:
    def __init__(self, limiter: RateLimiter, audit: AuditLog, *, tenant_share: int) -> None:
        self.limiter = limiter
        self.audit = audit
        self.tenant_share = tenant_share
        self.held: dict[str, int] = {}  # requests in flight per tenant, on this process

    @contextlib.contextmanager
    def share(self, caller: Caller, headers: Headers) -> Iterator[None]:
        """The request holds one of its tenant's share of this process's requests in flight while it
        runs (a stream or a subscription: as long as it is open). Beyond the share: 429 and
        Retry-After, before anything else is read, so no tenant can fill the process-wide cap
        (MCP_TASKS_MAX_CONCURRENT_REQUESTS) that answers everyone 503."""
        tenant = caller.principal.tenant_id
        held = self.held.get(tenant, 0)
        if held >= self.tenant_share:
            metrics.denied("tenant_share", tenant)
            metrics.rate_limited.labels("tenant_share").inc()
            code = v2026.RATE_LIMITED if headers.get(VERSION_HEADER) == v2026.VERSION else RATE_LIMITED
            raise Refusal(
                code,
                f"this tenant holds its share of this server's requests in flight ({held} of "
                f"MCP_TASKS_REQUEST_TENANT_SHARE={self.tenant_share}, streams and subscriptions included): close "
                "one, or retry after 1 s",
                status=429,
                headers={"Retry-After": "1"},
            )
        self.held[tenant] = held + 1
        try:
            yield
        finally:
            if (left := self.held[tenant] - 1) > 0:
                self.held[tenant] = left
            else:
                del self.held[tenant]

    async def check(self, caller: Caller, headers: Headers) -> None:
        """A 429 when the principal is over its rate; the denial audited at most once per interval."""
        principal = caller.principal
        if limited := await self.limiter.request(principal):
            metrics.denied("rate_limited", principal.tenant_id)
            if await self.limiter.may_record_denial(f"p:{principal.tenant_id}\x00{principal.subject}"):
                await self.audit.deny(caller, "rate_limited", scope=limited.scope)
            raise throttled(limited, headers)
