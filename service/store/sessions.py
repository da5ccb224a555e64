"""MCP sessions (2025-11-25), bound to the principal that opened them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from service.domain.principal import Principal
from service.domain.values import frozen
from service.store.db import Database
from service.store.events import SessionChanged, notify
from service.store.queries import Q


@frozen
class StoredSession:
    session_id: str
    protocol_version: str
    client_capabilities: dict[str, Any]
    log_level: str | None
    last_seen_at: datetime


class SessionStore:
    """MCP sessions (2025-11-25), bound to the principal that opened them."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def insert(
        self,
        principal: Principal,
        session_id: str,
        protocol_version: str,
        client_capabilities: dict[str, Any],
        client_info: dict[str, Any] | None,
        *,
        keep: int,
    ) -> list[str]:
        """Store a new session; the principal's least recently used sessions beyond ``keep`` end
        in the same transaction, and their ids are returned."""
        async with self.db.transaction(principal.tenant_id) as conn:
            await conn.execute(
                Q["insert_session"], principal.tenant_id, session_id, principal.subject, protocol_version,
                client_capabilities, client_info,
            )  # fmt: skip
            rows = await conn.fetch(Q["trim_sessions"], principal.tenant_id, principal.subject, keep)
            for row in rows:
                await notify(conn, SessionChanged(principal.tenant_id, row["session_id"]))
        return [row["session_id"] for row in rows]

    async def get(self, principal: Principal, session_id: str, *, touch_after_s: float) -> StoredSession | None:
        """The session if it is the principal's; its last use is refreshed when older than ``touch_after_s``."""
        async with self.db.transaction(principal.tenant_id) as conn:
            row = await conn.fetchrow(Q["get_session"], principal.tenant_id, session_id, principal.subject)
            if row is None:
                return None
            if row["idle_s"] > touch_after_s:
                await conn.execute(Q["touch_session"], principal.tenant_id, session_id)
        return StoredSession(
            row["session_id"], row["protocol_version"], row["client_capabilities"], row["log_level"],
            row["last_seen_at"],
        )  # fmt: skip

    async def set_log_level(self, principal: Principal, session_id: str, level: str) -> None:
        async with self.db.transaction(principal.tenant_id) as conn:
            await conn.execute(Q["set_session_log_level"], principal.tenant_id, session_id, level)
            await notify(conn, SessionChanged(principal.tenant_id, session_id))

    async def delete(self, principal: Principal, session_id: str) -> bool:
        async with self.db.transaction(principal.tenant_id) as conn:
            row = await conn.fetchrow(Q["delete_session"], principal.tenant_id, session_id, principal.subject)
            if row is not None:
                await notify(conn, SessionChanged(principal.tenant_id, session_id))
        return row is not None
