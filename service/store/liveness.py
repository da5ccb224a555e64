"""A runner proves it is alive by holding a session-level advisory lock on its own connection.

When the process dies, PostgreSQL closes that connection and releases the lock at once, so the
reaper can fail or re-queue the runner's tasks without waiting for the lease to run out.
"""

from __future__ import annotations

import secrets

import asyncpg


class LivenessLock:
    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        # A positive signed 64-bit key, stored with each leased task (tasks.lease_key).
        self.key = secrets.randbits(62) + 1
        self._conn: asyncpg.Connection | None = None

    async def acquire(self) -> None:
        self._conn = await asyncpg.connect(self._dsn, server_settings={"application_name": "mcp-tasks-runner"})
        await self._conn.execute("SELECT pg_advisory_lock($1)", self.key)

    @property
    def held(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    async def ensure(self) -> None:
        """Re-take the lock after the connection dropped (e.g. a database restart)."""
        if not self.held:
            await self.acquire()

    async def release(self) -> None:
        if self._conn is not None and not self._conn.is_closed():
            await self._conn.close()
        self._conn = None
