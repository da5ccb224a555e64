"""What each process sees of its upstream MCP servers, for ``mcp-tasks upstreams`` (queries:
``sql/upstreams.sql``). Written with the runner role; read by the operator's command."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from service.store.db import Database
from service.store.queries import Q


@dataclass(frozen=True)
class UpstreamState:
    owner: str
    upstream: str
    state: dict[str, Any]
    seen_at: datetime


class UpstreamStates:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def publish(self, owner: str, states: list[dict[str, Any]], live_ms: int) -> None:
        """Each state is one upstream's ``status()``: its ``name`` keys the row."""
        async with self.db.connection() as conn, conn.transaction():
            for state in states:
                await conn.execute(Q["publish_upstream_state"], owner, state["name"], state, live_ms)

    async def withdraw(self, owner: str) -> None:
        async with self.db.connection() as conn:
            await conn.execute(Q["withdraw_upstream_states"], owner)

    async def live(self) -> list[UpstreamState]:
        async with self.db.connection() as conn:
            rows = await conn.fetch(Q["live_upstream_states"])
        return [UpstreamState(r["owner"], r["upstream"], r["state"], r["seen_at"]) for r in rows]
