"""TaskRunContext: the tool context of a call running as a task (events published, questions stored)."""

from __future__ import annotations

import asyncio
import contextlib

from service.domain.events import LogEntry, Progress, TaskEvent
from service.domain.inputs import InputResponse, PendingInput
from service.domain.task import Task
from service.store.events import EventHub, TaskLog, TaskProgress
from service.store.repository import RunnerStore
from service.tools.context import ToolContextBase


class TaskRunContext(ToolContextBase):
    """Bound to one claimed task and the runner that holds its lease."""

    def __init__(self, task: Task, *, owner: str, store: RunnerStore, hub: EventHub, poll_s: float) -> None:
        super().__init__(
            task_id=task.task_id, progress_token=task.progress_token, client_capabilities=task.client_capabilities
        )
        self._task = task
        self._owner = owner
        self._store = store
        self._hub = hub
        self._poll_s = poll_s

    async def _emit(self, event: TaskEvent) -> None:
        t = self._task
        if isinstance(event, Progress):
            out: TaskProgress | TaskLog = TaskProgress(
                t.tenant_id, t.task_id, t.session_id, event.token, event.progress, event.total, event.message
            )
        elif isinstance(event, LogEntry):
            out = TaskLog(t.tenant_id, t.task_id, t.session_id, event.level, event.data, event.logger)
        else:  # pragma: no cover - the base emits nothing else
            return
        with contextlib.suppress(Exception):  # progress and logs are best effort (P-2)
            await self._hub.publish(out)

    async def _ask(self, question: PendingInput) -> InputResponse:
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
