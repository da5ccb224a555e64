"""How a call running as a task talks to its client: events published, questions stored.

``TaskSink`` is the task side of a tool context: the runner's context (``TaskRunContext``) uses it
from the start, and a call that began inside its request (``service.tasks.calls``) switches to it
when it becomes a task.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from service.domain.events import LogEntry, Progress, TaskEvent
from service.domain.inputs import InputResponse, PendingInput
from service.domain.task import Task
from service.store.events import EventHub, TaskLog, TaskProgress
from service.store.runners import RunnerStore
from service.tools.context import ToolContextBase


class TaskSink:
    """Bound to one task and the runner that holds its lease."""

    def __init__(self, task: Task, *, owner: str, store: RunnerStore, hub: EventHub, poll_s: float) -> None:
        self._task = task
        self._owner = owner
        self._store = store
        self._hub = hub
        self._poll_s = poll_s

    async def emit(self, event: TaskEvent) -> None:
        t = self._task
        if isinstance(event, Progress):
            out: TaskProgress | TaskLog = TaskProgress(
                t.tenant_id, t.task_id, t.session_id, event.token, event.progress, event.total, event.message
            )
        elif isinstance(event, LogEntry):
            out = TaskLog(t.tenant_id, t.task_id, t.session_id, event.level, event.data, event.logger)
        else:  # pragma: no cover - tool contexts emit nothing else
            return
        with contextlib.suppress(Exception):  # progress and logs are best effort (P-2)
            await self._hub.publish(out)

    async def ask(self, question: PendingInput) -> InputResponse:
        """Store the question (input_required), wait for its answer; the answer makes it working again."""
        t = self._task
        async with self._hub.subscribe(("task", t.tenant_id, t.task_id)) as events:
            if not await self._store.ask(t, self._owner, question):
                raise asyncio.CancelledError  # cancelled or lease lost under us
            while True:
                response = await self._store.response(t.tenant_id, t.task_id, question.key)
                if response is not None:
                    return response
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(events.get(), timeout=self._poll_s)


class TaskRunContext(ToolContextBase):
    """The context of a task a runner claimed: everything goes through its TaskSink."""

    def __init__(self, task: Task, sink: TaskSink, client_capabilities: dict[str, Any] | None = None) -> None:
        """``client_capabilities``: what the task's client declared, when the task row does not
        carry it (a session's task: the session's, read when the run began)."""
        super().__init__(
            task_id=task.task_id,
            progress_token=task.progress_token,
            client_capabilities=task.client_capabilities if client_capabilities is None else client_capabilities,
        )
        self._sink = sink

    async def _emit(self, event: TaskEvent) -> None:
        await self._sink.emit(event)

    async def _ask(self, question: PendingInput) -> InputResponse:
        return await self._sink.ask(question)
