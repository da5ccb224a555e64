"""Idle sessions of one Streamable HTTP upstream, kept for the next call with the same headers.

A session carries one call at a time (so the upstream's questions still name their call) of one
caller (the key holds the caller and the headers naming it: nothing an upstream keeps per session
passes from one tenant to another), and is reused instead of opening a new one (initialize, initialized, and a DELETE at the end: three
requests a call saved). A session is reused for at most ``REUSE_S`` after it was opened, so a
rotated bearer file or a refreshed token reaches the upstream within that, and only after a call
that ended well on it; anything else closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Final

from service.upstream.connection import Connection

REUSE_S: Final = 60.0
Key = tuple[tuple[str, str], ...]


class SessionPool:
    def __init__(self, most: int) -> None:
        self.most = most  # idle sessions kept per key
        self._idle: dict[Key, list[Connection]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    async def take(
        self, key: Key, open_one: Callable[[], Awaitable[Connection]], *, fresh: bool = False
    ) -> tuple[Connection, bool]:
        """A session for a call, and whether it was used before (``fresh``: a new one)."""
        loop = asyncio.get_running_loop()
        idle = self._idle.get(key, [])
        while idle and not fresh:
            conn = idle.pop()
            if not conn.ended.is_set() and loop.time() - conn.opened_at < REUSE_S:
                return conn, True
            self._close_later(conn)
        return await open_one(), False

    def give(self, key: Key, conn: Connection, *, reusable: bool) -> None:
        """The call on ``conn`` ended: keep it for the next (``reusable``: it ended well), or close it."""
        idle = self._idle.setdefault(key, [])
        if reusable and not conn.ended.is_set() and len(idle) < self.most:
            idle.append(conn)
        else:
            self._close_later(conn)

    def _close_later(self, conn: Connection) -> None:
        closing = asyncio.ensure_future(conn.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                self._close_later(conn)
        self._idle.clear()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._closing, return_exceptions=True)
