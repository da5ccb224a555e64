"""Events between processes over LISTEN/NOTIFY: every payload defined here, typed and versioned.

An event is sent with ``pg_notify`` inside the transaction that made the change, so it arrives only
after commit; the SQL functions of the schema send ``created`` and ``status`` events in exactly
the form ``TaskCreated`` and ``TaskChanged`` define. Events are hints: every waiter re-reads the
database and also polls on a timer, so a lost LISTEN connection slows things down but never loses
a task.

Only ids travel over NOTIFY (issue 14, finding 3): an event that carries what a client or a tool
said (progress and log text, a plain call's answer) is always stored in ``event_payloads`` and sent
by reference (``{"v", "k", "tenant_id", "ref"}``), and so is any event larger than NOTIFY takes
(8000 bytes). The receiving hub reads it back, under the tenant's row-level security, before
dispatching it; such an event arriving inline, or a reference to no stored row of that tenant, is
dropped. Every receiver of an id-only event re-reads the row it names before acting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import asyncpg
import orjson

from service.concurrency.stopping import cancel_and_wait
from service.domain.values import frozen
from service.store.db import Database
from service.store.queries import Q

log = logging.getLogger(__name__)

CHANNEL = "mcp_tasks"
VERSION = 1
Topic = tuple[str, ...]
# NOTIFY payloads are limited to 8000 bytes (with the channel name); larger events go by reference.
MAX_INLINE = 7_900
# Events read back by reference at once (each a short transaction); more wait, and past four times
# as many the hints are dropped (waiters poll).
MAX_FETCHES = 8


@frozen
class Event:
    KIND: ClassVar[str] = ""
    # Carries text from a client or a tool: never inline over NOTIFY, only by reference.
    BY_REFERENCE: ClassVar[bool] = False
    tenant_id: str

    def topics(self) -> list[Topic]:
        return [("kind", self.KIND)]


@frozen
class TaskEvent(Event):
    task_id: str

    def topics(self) -> list[Topic]:
        return [("kind", self.KIND), ("task", self.tenant_id, self.task_id)]


@frozen
class TaskCreated(TaskEvent):
    """A task is queued for a runner (sent by the schema's create and re-queue functions)."""

    KIND: ClassVar[str] = "created"


@frozen
class TaskChanged(TaskEvent):
    """A task's row changed (status, outcome, questions); ``session_id`` routes it to a GET stream."""

    KIND: ClassVar[str] = "status"
    session_id: str | None = None

    def topics(self) -> list[Topic]:
        out = TaskEvent.topics(self)
        if self.session_id:
            out.append(("session", self.tenant_id, self.session_id))
        return out


@frozen
class TaskCancelRequested(TaskEvent):
    """Stop running this task: it was cancelled (its row says so)."""

    KIND: ClassVar[str] = "cancel"


@frozen
class TaskDeleted(TaskEvent):
    KIND: ClassVar[str] = "deleted"


@frozen
class InputAnswered(TaskEvent):
    """A client answered some of a task's questions (the answers are in the row)."""

    KIND: ClassVar[str] = "answer"


@frozen
class TaskProgress(TaskEvent):
    KIND: ClassVar[str] = "progress"
    BY_REFERENCE: ClassVar[bool] = True
    session_id: str | None
    token: str | int
    progress: float
    total: float | None = None
    message: str | None = None

    def topics(self) -> list[Topic]:
        return TaskChanged.topics(self)  # type: ignore[arg-type]


@frozen
class TaskLog(TaskEvent):
    KIND: ClassVar[str] = "log"
    BY_REFERENCE: ClassVar[bool] = True
    session_id: str | None
    level: str
    data: Any
    logger: str | None = None

    def topics(self) -> list[Topic]:
        return TaskChanged.topics(self)  # type: ignore[arg-type]


@frozen
class PlainAnswer(Event):
    """A client's answer to a question of a plain (non-task) call, for whichever process runs it."""

    KIND: ClassVar[str] = "plain_answer"
    BY_REFERENCE: ClassVar[bool] = True
    subject: str
    key: str
    response: dict[str, Any]


@frozen
class PlainCancel(Event):
    """Stop a plain call (notifications/cancelled), wherever it runs."""

    KIND: ClassVar[str] = "plain_cancel"
    session_id: str
    request: str


@frozen
class SessionChanged(Event):
    KIND: ClassVar[str] = "session_changed"
    session_id: str


@frozen
class Resync(Event):
    """Local only: the listener was away, so anything may have changed."""

    KIND: ClassVar[str] = "resync"


@frozen
class ToolsChanged(Event):
    """Local only: this process's tool list changed (an upstream's tools came, went or changed).
    Every replica follows its upstreams itself, so each tells its own streams."""

    KIND: ClassVar[str] = "tools_changed"

    def topics(self) -> list[Topic]:
        return [("tools",)]


_KINDS: dict[str, type[Event]] = {
    cls.KIND: cls
    for cls in (
        TaskCreated, TaskChanged, TaskCancelRequested, TaskDeleted, InputAnswered, TaskProgress, TaskLog,
        PlainAnswer, PlainCancel, SessionChanged,
    )
}  # fmt: skip


def encode(event: Event) -> bytes:
    body = {"v": VERSION, "k": event.KIND, **{f.name: getattr(event, f.name) for f in dataclasses.fields(event)}}
    return orjson.dumps(body)


# Each kind's field names, for decode (dataclasses.fields builds a tuple on every call).
_FIELDS: dict[type[Event], frozenset[str]] = {
    cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _KINDS.values()
}


def decode(body: dict[str, Any], *, inline: bool = False) -> Event | None:
    """The event of a payload, or None for one this version does not know (a newer replica's), or
    for one that came ``inline`` over NOTIFY but is only ever sent by reference (a forgery)."""
    if body.get("v", VERSION) != VERSION:
        return None
    cls = _KINDS.get(str(body.get("k")))
    if cls is None or (inline and cls.BY_REFERENCE):
        return None
    names = _FIELDS[cls]
    fields = {k: v for k, v in body.items() if k in names}
    # Routing fields must be text: anything else is not one of ours.
    if any(not isinstance(fields.get(k, ""), str) for k in ("tenant_id", "task_id", "session_id", "subject", "key")
           if fields.get(k) is not None):  # fmt: skip
        return None
    try:
        return cls(**fields)
    except TypeError:
        return None


async def notify(conn: asyncpg.Connection, event: Event) -> None:
    """Queue an event on this connection's transaction (sent at commit); large ones by reference."""
    raw = encode(event)
    if event.BY_REFERENCE or len(raw) > MAX_INLINE:
        ref = await conn.fetchval(Q["store_event_payload"], event.tenant_id, orjson.loads(raw))
        raw = orjson.dumps({"v": VERSION, "k": event.KIND, "tenant_id": event.tenant_id, "ref": ref})
    await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, raw.decode())


class EventHub:
    """One LISTEN connection per process, fanned out to in-process queues and listeners."""

    def __init__(self, db: Database, *, reconnect_delay: float = 1.0) -> None:
        self._db = db
        self._subs: dict[Topic, set[asyncio.Queue[Event]]] = defaultdict(set)
        self._conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._reconnect_delay = reconnect_delay
        self._connected = asyncio.Event()
        self._fetches: set[asyncio.Task[None]] = set()
        self._fetch_slots = asyncio.Semaphore(MAX_FETCHES)
        self.listeners: list[Callable[[Event], None]] = []

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-hub")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout=10)

    async def stop(self) -> None:
        await cancel_and_wait(*(job for job in [self._task, *self._fetches] if job is not None))
        if self._conn is not None and not self._conn.is_closed():
            await self._conn.close()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def _run(self) -> None:
        while True:
            try:
                self._conn = await asyncpg.connect(
                    self._db.dsn, server_settings={"application_name": "mcp-tasks-listen"}
                )
                lost = asyncio.Event()
                self._conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                await self._conn.add_listener(CHANNEL, self._on_notify)
                self._connected.set()
                # Wake everyone once: anything may have happened while we were not listening.
                self.dispatch(Resync(""))
                await lost.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("event listener disconnected: %s; retrying", exc)
            self._connected.clear()
            await asyncio.sleep(self._reconnect_delay)

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        try:
            body = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(body, dict):
            return
        if "ref" in body:
            if len(self._fetches) >= MAX_FETCHES * 4:  # a flood of references: drop hints, waiters poll
                return
            job = asyncio.get_running_loop().create_task(self._fetch(body))
            self._fetches.add(job)
            job.add_done_callback(self._fetches.discard)
            return
        if (event := decode(body, inline=True)) is not None:
            self.dispatch(event)

    async def _fetch(self, body: dict[str, Any]) -> None:
        """An event sent by reference: read it back (as its tenant) and dispatch it. A reference to
        no stored row of that tenant (forged, or already tidied away) is dropped."""
        tenant_id = body.get("tenant_id")
        if not isinstance(tenant_id, str):
            return
        try:
            async with self._fetch_slots, self._db.transaction(tenant_id) as conn:
                stored = await conn.fetchval(Q["get_event_payload"], int(body["ref"]))
        except Exception as exc:  # a hint lost: waiters poll
            log.warning("could not read an event sent by reference: %s", exc)
            return
        if not isinstance(stored, dict) or stored.get("tenant_id") != tenant_id:
            return
        if (event := decode(stored)) is not None and body.get("k") == event.KIND:
            self.dispatch(event)

    def dispatch(self, event: Event) -> None:
        """Deliver to local listeners and subscribers (also for purely local events), once per queue."""
        for listener in self.listeners:
            listener(event)
        if isinstance(event, Resync):
            targets = {q for queues in self._subs.values() for q in queues}
        else:
            targets = {q for topic in event.topics() for q in self._subs.get(topic, ())}
        for queue in targets:
            queue.put_nowait(event)

    @contextlib.asynccontextmanager
    async def subscribe(self, *topics: Topic) -> AsyncIterator[asyncio.Queue[Event]]:
        subscription = self.open(*topics)
        try:
            yield subscription.queue
        finally:
            subscription.close()

    def subscribers(self, topic: Topic) -> int:
        """How many subscriptions of this process listen to ``topic`` now."""
        return len(self._subs.get(topic, ()))

    def open(self, *topics: Topic) -> Subscription:
        """A subscription whose owner closes it (``subscribe`` for one that ends with a block)."""
        queue: asyncio.Queue[Event] = asyncio.Queue()
        for topic in topics:
            self._subs[topic].add(queue)
        return Subscription(self, topics, queue)

    def _close(self, topics: tuple[Topic, ...], queue: asyncio.Queue[Event]) -> None:
        for topic in topics:
            subs = self._subs.get(topic)
            if subs is not None:
                subs.discard(queue)
                if not subs:
                    del self._subs[topic]

    async def publish(self, event: Event) -> None:
        """Send an event outside any transaction (progress, plain-call signals); an outage is Unavailable."""
        async with self._db.transaction(event.tenant_id) as conn:
            await notify(conn, event)


class Subscription:
    """Events of some topics, queued from the moment it was opened until ``close`` (idempotent)."""

    def __init__(self, hub: EventHub, topics: tuple[Topic, ...], queue: asyncio.Queue[Event]) -> None:
        self._hub = hub
        self._topics = topics
        self.queue = queue
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self._hub._close(self._topics, self.queue)
