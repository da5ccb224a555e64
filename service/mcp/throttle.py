"""The third layer: the principal's rate limit (slowapi's limits, shared storage)."""

from __future__ import annotations

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
    def __init__(self, limiter: RateLimiter, audit: AuditLog) -> None:
        self.limiter = limiter
        self.audit = audit

    async def check(self, caller: Caller, headers: Headers) -> None:
        """A 429 when the principal is over its rate; the denial audited at most once per interval."""
        principal = caller.principal
        if limited := await self.limiter.request(principal):
            metrics.denied("rate_limited", principal.tenant_id)
            if await self.limiter.may_record_denial(f"p:{principal.tenant_id}\x00{principal.subject}"):
                await self.audit.deny(caller, "rate_limited", scope=limited.scope)
            raise throttled(limited, headers)
