"""MCP sessions (2025-11-25): opened by initialize, bound to the principal, ended by DELETE."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from service.domain.principal import Principal
from service.store import repository as repo
from service.store.db import Database

TOUCH_EVERY = timedelta(minutes=1)


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    protocol_version: str
    client_capabilities: dict[str, Any]
    log_level: str | None = None


class SessionService:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def open(
        self,
        principal: Principal,
        protocol_version: str,
        client_capabilities: dict[str, Any],
        client_info: dict[str, Any] | None,
    ) -> Session:
        # H-SESS-2: CSPRNG, visible ASCII only.
        session_id = secrets.token_urlsafe(24)
        async with self.db.transaction(principal.tenant_id) as conn:
            await repo.insert_session(conn, principal, session_id, protocol_version, client_capabilities, client_info)
        return Session(session_id, protocol_version, client_capabilities)

    async def resolve(self, principal: Principal, session_id: str) -> Session | None:
        """The session if it exists and belongs to this principal (H-SESS-7); else None."""
        async with self.db.transaction(principal.tenant_id) as conn:
            row = await repo.get_session(conn, principal, session_id)
            if row is None:
                return None
            if datetime.now(UTC) - row["last_seen_at"] > TOUCH_EVERY:
                await repo.touch_session(conn, principal.tenant_id, session_id)
        return Session(row["session_id"], row["protocol_version"], row["client_capabilities"], row["log_level"])

    async def set_log_level(self, principal: Principal, session_id: str, level: str) -> None:
        async with self.db.transaction(principal.tenant_id) as conn:
            await repo.set_session_log_level(conn, principal.tenant_id, session_id, level)

    async def end(self, principal: Principal, session_id: str) -> bool:
        async with self.db.transaction(principal.tenant_id) as conn:
            return await repo.delete_session(conn, principal, session_id)
