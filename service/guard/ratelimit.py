"""Rate limits (T-SEC-6) on slowapi's limiter: per principal, per client address before
authentication, and a tighter budget for task lookups that find nothing (id enumeration).

The MCP endpoint is a pure ASGI app whose key (the verified principal) exists only after
authentication, so slowapi's route decorators do not fit; its ``Limiter`` still configures the
storage (``memory://`` or ``redis://…`` shared by every replica) and the sliding-window-counter
strategy (two counters per key, where a moving window keeps every hit of the window: thousands of
entries per busy key, copied by the memory storage's expiry thread), which we call directly.
Remote storage is hit from a worker thread so the event loop never blocks. A storage outage fails
open (requests pass) or closed (503, retry shortly), as ``MCP_TASKS_RATE_LIMIT_FAIL`` says; it is
counted, and logged once when it starts and once when it ends.

One storage call per request: the principal's budget. The address budget is checked only before
verifying a token not verified before, and a principal whose lookups budget was seen unspent is
not asked again for LOOKUPS_CLEAR_S unless it misses here (misses on other replicas take effect
within that time).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import orjson
from limits import RateLimitItem, parse
from slowapi import Limiter

from service.config import Settings
from service.domain.errors import Unavailable
from service.domain.principal import Principal

log = logging.getLogger(__name__)

DENIAL_ROWS = "20/minute"
# A hung Redis must cost a request milliseconds, not the client library's default seconds.
STORAGE_TIMEOUT_S = 0.25
LOOKUPS_CLEAR_S = 1.0
_CLEAR_MAX = 100_000


@dataclass(frozen=True, slots=True)
class RateLimited:
    """Over a limit: answer 429 with Retry-After."""

    scope: str  # principal | unauthenticated | not_found
    limit: str
    retry_after_s: int

    @property
    def message(self) -> str:
        return (
            f"rate limit exceeded ({self.limit} per {self.scope.replace('_', ' ')}); retry after {self.retry_after_s} s"
        )


class RateLimiter:
    def __init__(self, settings: Settings, *, on_storage_error: Callable[[], None] | None = None) -> None:
        self._limiter = Limiter(
            key_func=lambda *_: "",  # keys are chosen per call below, not from the request
            storage_uri=settings.rate_limit_storage,
            storage_options=cast(
                "dict[str, str]",  # slowapi types it so, redis-py takes numbers
                (
                    {}
                    if settings.rate_limit_storage.startswith("memory://")
                    else {"socket_timeout": STORAGE_TIMEOUT_S, "socket_connect_timeout": STORAGE_TIMEOUT_S}
                ),
            ),
            strategy="sliding-window-counter",
            key_prefix="mcp_tasks",
        )
        self._strategy = self._limiter.limiter
        self._remote = not settings.rate_limit_storage.startswith("memory://")
        self._limits = {
            "principal": parse(settings.rate_limit),
            "unauthenticated": parse(settings.rate_limit_unauthenticated),
            "not_found": parse(settings.rate_limit_not_found),
            # Audit rows for repeated refusals of one key: past this, refusals are only counted.
            "denial_rows": parse(DENIAL_ROWS),
        }
        self._texts = {
            "principal": settings.rate_limit,
            "unauthenticated": settings.rate_limit_unauthenticated,
            "not_found": settings.rate_limit_not_found,
            "denial_rows": DENIAL_ROWS,
        }
        self._on_storage_error = on_storage_error
        self._fail_open = settings.rate_limit_fail == "open"
        self._storage_down = False
        # principal key -> monotonic time until which its lookups budget is taken as unspent
        self._lookups_clear: dict[str, float] = {}

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._remote:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _apply(self, scope: str, key: str, *, hit: bool) -> RateLimited | None:
        item: RateLimitItem = self._limits[scope]
        try:
            allowed = await self._call(self._strategy.hit if hit else self._strategy.test, item, key)
            stats = None if allowed else await self._call(self._strategy.get_window_stats, item, key)
        except Exception as exc:  # storage down: open (let through) or closed (retry later), as set
            if self._on_storage_error is not None:
                self._on_storage_error()
            if not self._storage_down:  # one line when it goes, one when it is back
                self._storage_down = True
                verdict = "letting requests through" if self._fail_open else "refusing requests (503)"
                log.warning("rate limit storage unreachable (%s): %s until it is back", type(exc).__name__, verdict)
            if self._fail_open:
                return None
            raise Unavailable("rate limit storage unreachable") from None
        if self._storage_down:  # on the first answer after an outage, whether it allows or refuses
            self._storage_down = False
            log.warning("rate limit storage reachable again")
        if stats is None:
            return None
        return RateLimited(scope, self._texts[scope], max(1, math.ceil(stats.reset_time - time.time())))

    @staticmethod
    def _principal_key(principal: Principal) -> str:
        # JSON, not "a:b:c": tenant and subject may contain any character, and keys must not collide.
        return "p" + orjson.dumps([principal.tenant_id, principal.subject]).decode()

    async def may_record_denial(self, key: str) -> bool:
        """At most DENIAL_ROWS audit rows per refused key, so a flood has no lever on the database."""
        return await self._apply("denial_rows", f"d:{key}", hit=True) is None

    async def request(self, principal: Principal) -> RateLimited | None:
        """Count one authenticated request against the principal's budget."""
        return await self._apply("principal", self._principal_key(principal), hit=True)

    async def unauthenticated_blocked(self, address: str) -> RateLimited | None:
        """Is this address out of failed-authentication budget? (checked before verifying a token)"""
        return await self._apply("unauthenticated", f"a:{address}", hit=False)

    async def authentication_failed(self, address: str) -> RateLimited | None:
        return await self._apply("unauthenticated", f"a:{address}", hit=True)

    async def lookups_blocked(self, principal: Principal) -> RateLimited | None:
        """Has this principal spent its budget of lookups that found nothing?"""
        key = self._principal_key(principal)
        now = time.monotonic()
        if self._lookups_clear.get(key, 0.0) > now:
            return None
        limited = await self._apply("not_found", key, hit=False)
        if limited is None:
            if len(self._lookups_clear) >= _CLEAR_MAX:
                self._lookups_clear.clear()
            self._lookups_clear[key] = now + LOOKUPS_CLEAR_S
        return limited

    async def lookup_missed(self, principal: Principal) -> None:
        key = self._principal_key(principal)
        self._lookups_clear.pop(key, None)
        await self._apply("not_found", key, hit=True)
