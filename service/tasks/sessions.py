"""Client sessions (2025-11-25): opened on the client's first request, bound to the principal, ended on request."""

from __future__ import annotations

import secrets
import time
from typing import Any

from service.domain.principal import Principal
from service.domain.values import frozen
from service.store.db import Database
from service.store.events import Event, EventHub, Resync, SessionChanged
from service.store.sessions import SessionStore

TOUCH_EVERY_S = 60.0
# Every request names its session, so each replica keeps the sessions it has seen for a few
# seconds: a plain call then needs no database work. A change (the end, a new log level) is
# announced to every replica at commit; the expiry bounds staleness should that event be lost.
CACHE_SECONDS = 5.0
CACHE_MAX = 50_000


@frozen
class Session:
    session_id: str
    protocol_version: str
    client_capabilities: dict[str, Any]
    log_level: str | None = None


class SessionService:
    def __init__(
        self,
        db: Database,
        hub: EventHub | None = None,
        *,
        cache_seconds: float = CACHE_SECONDS,
        max_per_principal: int = 64,
    ) -> None:
        self.store = SessionStore(db)
        self.max_per_principal = max_per_principal
        self._cache_seconds = cache_seconds
        # (tenant, session id) -> (subject, session, monotonic expiry)
        self._cache: dict[tuple[str, str], tuple[str, Session, float]] = {}
        # Bumped by every invalidation: a lookup that raced one does not cache what it read.
        self._generation = 0
        if hub is not None:
            hub.listeners.append(self._on_event)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, SessionChanged):
            self._forget(event.tenant_id, event.session_id)
        elif isinstance(event, Resync):  # the listener was away: anything may have changed
            self._generation += 1
            self._cache.clear()

    def _forget(self, tenant_id: str, session_id: str) -> None:
        self._generation += 1
        self._cache.pop((tenant_id, session_id), None)

    def _remember(self, principal: Principal, session: Session) -> None:
        if len(self._cache) >= CACHE_MAX:
            self._cache.pop(next(iter(self._cache)))  # the oldest entry
        expiry = time.monotonic() + self._cache_seconds
        self._cache[(principal.tenant_id, session.session_id)] = (principal.subject, session, expiry)

    async def open(
        self,
        principal: Principal,
        protocol_version: str,
        client_capabilities: dict[str, Any],
        client_info: dict[str, Any] | None,
    ) -> Session:
        # H-SESS-2: CSPRNG, visible ASCII only.
        session_id = secrets.token_urlsafe(24)
        # Beyond the cap the least recently used session ends rather than the new one being
        # refused: a client that lost its sessions without DELETE can always start again.
        ended = await self.store.insert(
            principal, session_id, protocol_version, client_capabilities, client_info, keep=self.max_per_principal
        )
        for old in ended:
            self._forget(principal.tenant_id, old)
        session = Session(session_id, protocol_version, client_capabilities)
        self._remember(principal, session)
        return session

    async def resolve(self, principal: Principal, session_id: str) -> Session | None:
        """The session if it exists and belongs to this principal (H-SESS-7); else None."""
        cached = self._cache.get((principal.tenant_id, session_id))
        if cached is not None and cached[2] > time.monotonic():
            return cached[1] if cached[0] == principal.subject else None
        generation = self._generation
        row = await self.store.get(principal, session_id, touch_after_s=TOUCH_EVERY_S)
        if row is None:
            return None
        session = Session(row.session_id, row.protocol_version, row.client_capabilities, row.log_level)
        if generation == self._generation:  # no change was announced while we read it
            self._remember(principal, session)
        return session

    async def set_log_level(self, principal: Principal, session_id: str, level: str) -> None:
        await self.store.set_log_level(principal, session_id, level)
        self._forget(principal.tenant_id, session_id)

    async def end(self, principal: Principal, session_id: str) -> bool:
        ended = await self.store.delete(principal, session_id)
        self._forget(principal.tenant_id, session_id)
        return ended
