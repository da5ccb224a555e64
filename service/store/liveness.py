"""A runner holds a session-level advisory lock on its own connection while it is connected.

Its key is stamped on every task the runner leases (tasks.lease_key). The lock no longer decides
anything: a lock that is gone does not prove the runner dead (a runner cut off from the database
loses it too, and still runs), so the reaper waits for the lease to run out (docs/decisions.md,
"Fencing"). It is still held so that a previous release's reaper, which reaps tasks whose lock is
gone, leaves this runner's tasks alone during a rolling upgrade.
"""

from __future__ import annotations

import secrets
import time

import asyncpg

from service.domain.errors import Unavailable

_LOST = (OSError, TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError, asyncpg.CannotConnectNowError)


class LivenessLock:
    def __init__(self, dsn: str, *, timeout_s: float = 10.0) -> None:
        self._dsn = dsn
        self._timeout_s = timeout_s
        # A positive signed 64-bit key, stored with each leased task (tasks.lease_key).
        self.key = secrets.randbits(62) + 1
        self._conn: asyncpg.Connection | None = None
        self._granted = False
        self._retry_at = 0.0

    async def acquire(self) -> None:
        """Connect (or reuse the connection) and try the lock, within the timeout: a database that
        does not answer must not hold the runner up. Not granted: the session this runner lost
        still holds it on the server (a half-open connection it has not noticed yet); tried again
        later, and meanwhile that session keeps the lock held for a previous release's reaper."""
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = None
                self._granted = False
                self._conn = await asyncpg.connect(
                    self._dsn,
                    timeout=self._timeout_s,
                    command_timeout=self._timeout_s,
                    server_settings={"application_name": "mcp-tasks-runner"},
                )
            self._granted = bool(await self._conn.fetchval("SELECT pg_try_advisory_lock($1)", self.key))
        except _LOST as exc:
            if self._conn is not None:
                self._conn.terminate()
                self._conn = None
            raise Unavailable(f"cannot take the runner's liveness lock: {exc}") from exc

    @property
    def held(self) -> bool:
        return self._granted and self._conn is not None and not self._conn.is_closed()

    async def ensure(self) -> None:
        """Re-take the lock after its connection dropped (a database restart, a network cut), at
        most once per timeout."""
        if self.held or time.monotonic() < self._retry_at:
            return
        self._retry_at = time.monotonic() + self._timeout_s
        await self.acquire()

    async def release(self) -> None:
        if self._conn is not None and not self._conn.is_closed():
            await self._conn.close()
        self._conn = None
        self._granted = False
