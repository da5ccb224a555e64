"""LISTEN/NOTIFY hub: replicas wake each other; local waiters subscribe to topics.

An event is a small JSON object ``{"k": kind, "t": tenant, "id": task_id, ...}`` sent with
``pg_notify`` inside the transaction that made the change, so it arrives only after commit.
Events are hints: every waiter re-reads the database and also polls on a timer, so a lost
LISTEN connection slows things down but never loses a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import orjson

log = logging.getLogger(__name__)

CHANNEL = "mcp_tasks"
Event = dict[str, Any]
Topic = tuple[str, ...]
# NOTIFY payloads are limited to 8000 bytes; larger events are trimmed to their routing keys.
_MAX_PAYLOAD = 7900


def encode_event(event: Event) -> str:
    raw = orjson.dumps(event)
    if len(raw) > _MAX_PAYLOAD:
        raw = orjson.dumps({k: event[k] for k in ("k", "t", "id", "s") if k in event})
    return raw.decode()


async def notify(conn: asyncpg.Connection, event: Event) -> None:
    """Queue an event on this connection's transaction (sent at commit)."""
    await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, encode_event(event))


def topics_for(event: Event) -> list[Topic]:
    """Which local subscribers an event concerns."""
    kind = event.get("k")
    tenant = str(event.get("t", ""))
    out: list[Topic] = [("kind", str(kind))]
    if "id" in event:
        out.append(("task", tenant, str(event["id"])))
    if event.get("s"):
        out.append(("session", tenant, str(event["s"])))
    return out


class EventHub:
    """One LISTEN connection per process, fanned out to in-process queues."""

    def __init__(self, dsn: str, *, reconnect_delay: float = 1.0) -> None:
        self._dsn = dsn
        self._subs: dict[Topic, set[asyncio.Queue[Event]]] = defaultdict(set)
        self._conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._reconnect_delay = reconnect_delay
        self._connected = asyncio.Event()
        self.listeners: list[Callable[[Event], None]] = []

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-hub")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout=10)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None and not self._conn.is_closed():
            await self._conn.close()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def _run(self) -> None:
        while True:
            try:
                self._conn = await asyncpg.connect(self._dsn, server_settings={"application_name": "mcp-tasks-listen"})
                lost = asyncio.Event()
                self._conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                await self._conn.add_listener(CHANNEL, self._on_notify)
                self._connected.set()
                # Wake everyone once: anything may have happened while we were not listening.
                self.dispatch({"k": "resync"})
                await lost.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("event listener disconnected: %s; retrying", exc)
            self._connected.clear()
            await asyncio.sleep(self._reconnect_delay)

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if isinstance(event, dict):
            self.dispatch(event)

    def dispatch(self, event: Event) -> None:
        """Deliver to local subscribers (also used for purely local events), once per queue."""
        for listener in self.listeners:
            listener(event)
        if event.get("k") == "resync":
            targets = {q for queues in self._subs.values() for q in queues}
        else:
            targets = {q for topic in topics_for(event) for q in self._subs.get(topic, ())}
        for queue in targets:
            queue.put_nowait(event)

    @contextlib.asynccontextmanager
    async def subscribe(self, *topics: Topic) -> AsyncIterator[asyncio.Queue[Event]]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        for topic in topics:
            self._subs[topic].add(queue)
        try:
            yield queue
        finally:
            for topic in topics:
                subs = self._subs.get(topic)
                if subs is not None:
                    subs.discard(queue)
                    if not subs:
                        del self._subs[topic]

    async def publish(self, pool: asyncpg.Pool, event: Event) -> None:
        """Send an event outside any transaction (e.g. progress, which is not stored)."""
        async with pool.acquire() as conn:
            await notify(conn, event)
