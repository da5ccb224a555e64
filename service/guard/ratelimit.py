"""Rate limits (T-SEC-6) on slowapi's limiter: per principal, per client address before
authentication, and a tighter budget for task lookups that find nothing (id enumeration).

The MCP endpoint is a pure ASGI app whose key (the verified principal) exists only after
authentication, so slowapi's route decorators do not fit; its ``Limiter`` still configures the
storage (``memory://`` or ``redis://…`` shared by every replica) and the sliding-window-counter
strategy (two counters per key, where a moving window keeps every hit of the window: thousands of
entries per busy key, copied by the memory storage's expiry thread), which we call directly.
Remote storage is hit from a worker thread so the event loop never blocks; ``memory://`` (one
process) is counted in the event loop by ``_LocalWindows``, the same strategy without a thread.
A storage outage fails open (requests pass) or closed (503, retry shortly), as
``MCP_TASKS_RATE_LIMIT_FAIL`` says; it is counted, and logged once when it starts and once when it
ends.

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
from typing import Any, cast

import orjson
from limits import RateLimitItem, parse
from slowapi import Limiter

from service.config import Settings
from service.domain.errors import Unavailable
from service.domain.principal import Principal
from service.domain.values import frozen

log = logging.getLogger(__name__)

DENIAL_ROWS = "20/minute"
# A hung Redis must cost a request milliseconds, not the client library's default seconds.
STORAGE_TIMEOUT_S = 0.25
LOOKUPS_CLEAR_S = 1.0
_CLEAR_MAX = 100_000


@frozen
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


class _LocalWindows:
    """The sliding-window counter of ``limits``' memory storage, for one process, without its
    expiry thread (restarted every 10 ms under load: about 4 % of a request's CPU) or its locks
    (one event loop). Same windows (aligned to multiples of the limit's period), same weighting
    (the previous window's count times the share of it still inside the sliding window, plus the
    current count) and the same answers for hit, test and the reset time; stale keys are dropped
    when the table grows. Keys are per scope: a principal's request budget and its lookups budget
    never share a counter, whatever their limits."""

    __slots__ = ("_hits", "_max_keys", "_periods")

    def __init__(self, max_keys: int = _CLEAR_MAX) -> None:
        # (scope, key) -> [window index, count in the previous window, count in the current one]
        self._hits: dict[tuple[str, str], list[int]] = {}
        self._periods: dict[str, int] = {}
        self._max_keys = max_keys

    def _window(self, scope: str, item: RateLimitItem, key: str, now: float) -> tuple[list[int], float]:
        period = item.get_expiry()
        self._periods[scope] = period
        index = int(now // period)
        entry = self._hits.get((scope, key))
        if entry is None:
            if len(self._hits) >= self._max_keys:
                self._drop_stale(now)
            entry = self._hits[(scope, key)] = [index, 0, 0]
        elif entry[0] != index:
            # One window on: the current count becomes the previous one; more: both are gone.
            entry[1] = entry[2] if entry[0] == index - 1 else 0
            entry[2] = 0
            entry[0] = index
        return entry, (now % period) / period

    def _drop_stale(self, now: float) -> None:
        stale = [k for k, e in self._hits.items() if e[0] < int(now // self._periods[k[0]]) - 1]
        for k in stale:
            del self._hits[k]
        if len(self._hits) >= self._max_keys:  # every key busy: start afresh rather than grow
            self._hits.clear()

    def hit(self, scope: str, item: RateLimitItem, key: str) -> bool:
        entry, elapsed = self._window(scope, item, key, time.time())
        if math.floor(entry[1] * (1 - elapsed) + entry[2]) + 1 > item.amount:
            return False
        entry[2] += 1
        return True

    def test(self, scope: str, item: RateLimitItem, key: str) -> bool:
        entry, elapsed = self._window(scope, item, key, time.time())
        return bool(entry[1] * (1 - elapsed) + entry[2] < item.amount)

    def reset_in(self, scope: str, item: RateLimitItem, key: str) -> float:
        """Seconds until the weighted count next drops (limits' get_window_stats reset time)."""
        now = time.time()
        entry, elapsed = self._window(scope, item, key, now)
        period = item.get_expiry()
        left = (1 - elapsed) * period
        previous = left % (period / entry[1]) if entry[1] else math.inf
        current = left if entry[2] else math.inf
        soonest = min(previous, current)
        return 0.0 if soonest == math.inf else soonest


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
        # memory://: counted here, in the event loop (limits' memory storage stays unused).
        self._local = None if self._remote else _LocalWindows()
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
        self._principal_keys: dict[tuple[str, str], str] = {}

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._remote:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _apply(self, scope: str, key: str, *, hit: bool) -> RateLimited | None:
        item: RateLimitItem = self._limits[scope]
        if self._local is not None:
            if self._local.hit(scope, item, key) if hit else self._local.test(scope, item, key):
                return None
            reset_in = self._local.reset_in(scope, item, key)
            return RateLimited(scope, self._texts[scope], max(1, math.ceil(reset_in)))
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

    def _principal_key(self, principal: Principal) -> str:
        # JSON, not "a:b:c": tenant and subject may contain any character, and keys must not collide.
        # Remembered per principal (a request asks for it once or twice; a bounded table).
        who = (principal.tenant_id, principal.subject)
        key = self._principal_keys.get(who)
        if key is None:
            if len(self._principal_keys) >= _CLEAR_MAX:
                self._principal_keys.clear()
            key = self._principal_keys[who] = "p" + orjson.dumps(list(who)).decode()
        return key

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
