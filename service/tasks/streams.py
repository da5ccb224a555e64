"""What streams carry: a task's events for a blocking result (2025-11-25), changes of watched tasks
(2026-07-28 subscriptions), and a session's notices (its GET stream). Events come from whichever
replica made the change (LISTEN/NOTIFY); a poll covers one lost on the way."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from service.domain.events import (
    Finished,
    InputRequested,
    InputVoided,
    LogEntry,
    Progress,
    SessionEvent,
    StatusChanged,
    TaskEvent,
    ToolListChanged,
)
from service.domain.principal import Caller, Principal
from service.domain.task import Task, TaskStatus
from service.store.events import (
    Event,
    EventHub,
    Resync,
    Subscription,
    TaskChanged,
    TaskDeleted,
    TaskLog,
    TaskProgress,
    ToolsChanged,
)
from service.store.tasks import TaskStore

Lookup = Callable[[Caller, str], Awaitable[Task | None]]
Retrieve = Callable[[Caller, str], Awaitable[Task]]


def notice_of(event: Event) -> TaskEvent | None:
    """The domain event of a progress or log event, if it is one."""
    if isinstance(event, TaskProgress):
        return Progress(event.task_id, event.token, event.progress, event.total, event.message)
    if isinstance(event, TaskLog):
        return LogEntry(event.task_id, event.level, event.data, event.logger)
    return None


class TaskStreams:
    def __init__(
        self, hub: EventHub, store: TaskStore, *, stale_delivery_ms: int, lookup: Lookup, retrieve: Retrieve
    ) -> None:
        """``lookup``: the caller's task or None (a read, never audited); ``retrieve``: the caller's
        task, its hand-out audited, or TaskNotFound."""
        self.hub = hub
        self.store = store
        self.stale_delivery_ms = stale_delivery_ms
        self._lookup = lookup
        self._retrieve = retrieve
        # Tasks with a result stream open in this process: their notices go there only.
        self.following: Counter[tuple[str, str]] = Counter()

    def watch_task(self, caller: Caller, task_id: str) -> Subscription:
        """The caller's task's events from now on: open it before a read that ``follow`` goes on
        from (``opened``), so no change after that read is missed."""
        return self.hub.open(("task", caller.principal.tenant_id, task_id))

    async def follow(
        self, caller: Caller, task_id: str, *, poll_s: float, opened: tuple[Subscription, Task] | None = None
    ) -> AsyncIterator[TaskEvent]:
        """Everything a blocking result stream (2025-11-25) carries, ending with Finished.

        Questions are claimed for this stream alone (no broadcast, H-MULTI-2) and released if the
        stream goes away unanswered, so the next result stream gets them. ``opened``: a
        subscription of ``watch_task`` and the task as read after it was opened (the stream starts
        from that read instead of reading again, and closes the subscription).
        """
        tenant = caller.principal.tenant_id
        stream_id = secrets.token_urlsafe(12)
        key = (tenant, task_id)
        carried = False  # whether this stream has claimed any of the task's questions
        subscription, known = opened if opened is not None else (self.watch_task(caller, task_id), None)
        self.following[key] += 1
        try:
            events = subscription.queue
            last_status = None
            loop = asyncio.get_running_loop()
            touched = loop.time()
            stale_ms = self.stale_delivery_ms
            while True:
                # Read after subscribing: no change is missed.
                if known is None:
                    task = await self._retrieve(caller, task_id)
                else:
                    task, known = known, None
                if task.status.is_terminal:
                    # C-10: questions this stream carried that nobody answered are void now.
                    if carried:
                        for input_key in await self.store.unanswered_for_stream(tenant, task_id, stream_id):
                            yield InputVoided(task_id, input_key, f"task {task.status.value}")
                    yield Finished(task)
                    return
                if last_status is not None and task.status != last_status:
                    yield StatusChanged(task)
                last_status = task.status
                # A task asks its client only while input_required (the question and the status
                # change commit together), so only then is there anything to claim.
                if task.status is TaskStatus.INPUT_REQUIRED:
                    pending = await self.store.claim_inputs(tenant, task_id, stream_id, stale_ms)
                    carried = carried or bool(pending)
                    for question in pending:
                        yield InputRequested(task_id, question)
                if carried and loop.time() - touched > stale_ms / 3000:
                    touched = loop.time()
                    await self.store.touch_deliveries(tenant, stream_id)
                # Wait for something to happen; notices are passed on without a re-read.
                while True:
                    try:
                        event = await asyncio.wait_for(events.get(), timeout=poll_s)
                    except TimeoutError:
                        break
                    if (notice := notice_of(event)) is not None:
                        yield notice
                        continue
                    break
        finally:
            subscription.close()
            self.following[key] -= 1
            if self.following[key] <= 0:
                del self.following[key]
            if carried:
                with contextlib.suppress(Exception):
                    await self.store.release_deliveries(tenant, stream_id)

    async def watch(self, caller: Caller, tasks: list[Task], *, poll_s: float) -> AsyncIterator[Task]:
        """Each change of the caller's ``tasks`` (as read now), until every one has ended. Changes
        made on any replica arrive through the store's events; a poll every ``poll_s`` covers an
        event lost on the way (XD-14)."""
        tenant = caller.principal.tenant_id
        seen: dict[str, tuple[Any, ...]] = {
            t.task_id: (t.status, t.last_updated_at) for t in tasks if not t.status.is_terminal
        }
        async with self.hub.subscribe(*(("task", tenant, task_id) for task_id in seen)) as events:
            while seen:
                changed: set[str] = set()
                try:
                    event = await asyncio.wait_for(events.get(), timeout=poll_s)
                    if isinstance(event, TaskChanged | TaskDeleted) and event.task_id in seen:
                        changed.add(event.task_id)
                    elif isinstance(event, Resync):
                        changed = set(seen)
                except TimeoutError:
                    changed = set(seen)
                for task_id in sorted(changed):
                    task = await self._lookup(caller, task_id)
                    if task is None:  # expired and deleted: nothing more to say
                        del seen[task_id]
                        continue
                    state = (task.status, task.last_updated_at)
                    if state != seen[task_id]:
                        seen[task_id] = state
                        yield task
                    if task.status.is_terminal:
                        del seen[task_id]

    @contextlib.asynccontextmanager
    async def tool_changes(self) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        """For a 2026-07-28 listen: a wait that returns at the next change of this process's tool
        list (subscribed on entry, so none after it is missed)."""
        async with self.hub.subscribe(("tools",)) as queue:

            async def changed() -> None:
                while not isinstance(await queue.get(), ToolsChanged):  # (a Resync is about tasks)
                    pass

            yield changed

    @contextlib.asynccontextmanager
    async def session_events(self, principal: Principal, session_id: str) -> AsyncIterator[AsyncIterator[SessionEvent]]:
        """For a session's GET stream: status changes and notices of tasks that session created,
        unless a result stream in this process already carries them (no duplicates), and changes
        of the tool list. Subscribed on entry, so nothing is missed between subscribing and iterating."""
        caller = Caller(principal)
        async with self.hub.subscribe(("session", principal.tenant_id, session_id), ("tools",)) as queue:

            async def events() -> AsyncIterator[SessionEvent]:
                while True:
                    event = await queue.get()
                    if isinstance(event, ToolsChanged):
                        yield ToolListChanged()
                        continue
                    task_id = getattr(event, "task_id", None)
                    if task_id is None or (principal.tenant_id, task_id) in self.following:
                        continue
                    if (notice := notice_of(event)) is not None:
                        yield notice
                    elif isinstance(event, TaskChanged):
                        task = await self._lookup(caller, task_id)
                        if task is not None:
                            yield StatusChanged(task)

            yield events()
