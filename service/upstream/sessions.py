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
    """At most ``most`` idle sessions in all (each holds a connection for the server's messages, so
    callers who never come back must not fill the upstream's connection pool): the one given back
    longest ago is closed for a new one. Sessions past ``REUSE_S`` are closed whenever one is taken
    or given back, whoever they were kept for."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._idle: list[tuple[Key, Connection]] = []  # in the order they were given back
        self._closing: set[asyncio.Task[None]] = set()

    async def take(
        self, key: Key, open_one: Callable[[], Awaitable[Connection]], *, fresh: bool = False
    ) -> tuple[Connection, bool]:
        """A session for a call, and whether it was used before (``fresh``: a new one)."""
        self._sweep()
        if not fresh:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i][0] == key:
                    return self._idle.pop(i)[1], True
        return await open_one(), False

    def give(self, key: Key, conn: Connection, *, reusable: bool) -> None:
        """The call on ``conn`` ended: keep it for the next (``reusable``: it ended well), or close it."""
        self._sweep()
        if not reusable or not self._usable(conn) or self.most <= 0:
            self._close_later(conn)
            return
        while len(self._idle) >= self.most:
            self._close_later(self._idle.pop(0)[1])
        self._idle.append((key, conn))

    def _usable(self, conn: Connection) -> bool:
        return not conn.ended.is_set() and asyncio.get_running_loop().time() - conn.opened_at < REUSE_S

    def _sweep(self) -> None:
        kept = [(key, conn) for key, conn in self._idle if self._usable(conn)]
        if len(kept) < len(self._idle):
            for _, conn in self._idle:
                if not self._usable(conn):
                    self._close_later(conn)
            self._idle = kept

    def _close_later(self, conn: Connection) -> None:
        closing = asyncio.ensure_future(conn.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for _, conn in self._idle:
            self._close_later(conn)
        self._idle.clear()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._closing, return_exceptions=True)
