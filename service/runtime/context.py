"""How a call running as a task talks to its client: events published, questions stored.

``TaskSink`` is the task side of a tool context: the runner's context (``TaskRunContext``) uses it
from the start, and a call that began inside its request (``service.tasks.calls``) switches to it
when it becomes a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any, Protocol

from service.domain.events import LogEntry, Progress, TaskEvent
from service.domain.inputs import InputResponse, PendingInput
from service.domain.task import FailureReason, Task, TaskStatus, Wire
from service.observability import metrics, tracing
from service.store.events import EventHub, TaskLog, TaskProgress
from service.store.runners import RunnerStore
from service.tools.api import refused
from service.tools.context import ProgressNote, ToolContextBase, progress_text

# A status message keeps this many characters of a tool's progress message.
MAX_STATUS_CHARS = 500


# A task's status message follows its progress at most this often (the last report always lands).
PROGRESS_STATUS_EVERY_S = 1.0
_writes: set[asyncio.Task[None]] = set()  # progress notes on their way (kept referenced)


class Waits(Protocol):
    """The runner's side of a run's wait for an answer (its slot given back meanwhile)."""

    def waiting(self) -> bool: ...

    async def resuming(self) -> None: ...


class TaskSink:
    """Bound to one task and the runner that holds its lease."""

    def __init__(
        self, task: Task, *, owner: str, store: RunnerStore, hub: EventHub, poll_s: float, input_timeout_s: float,
        waits: Waits | None = None,
    ) -> None:  # fmt: skip
        self._task = task
        self._waits = waits
        self._input_timeout_s = input_timeout_s
        self._owner = owner
        self._store = store
        self._hub = hub
        self._poll_s = poll_s
        # 2026-07-28: progress notifications reach no one once a call is a task (X-NOTIF-8), so the
        # task's status message carries the latest report (docs/decisions.md, "Progress as status").
        self.progress_status: ProgressNote | None = self._note_progress if task.wire == Wire.V2026.value else None
        self._noted: str | None = None
        self._noted_at = -math.inf
        self._flush: asyncio.Task[None] | None = None

    def _note_progress(self, progress: float, total: float | None, message: str | None) -> None:
        self.note_status(progress_text(progress, total, message))

    def note_status(self, text: str) -> None:
        """The latest report becomes the status message now, or (within PROGRESS_STATUS_EVERY_S of
        the last write) when that interval ends: the rate is bounded, the last report lands."""
        self._noted = text
        if self._flush is None or self._flush.done():
            wait = max(0.0, self._noted_at + PROGRESS_STATUS_EVERY_S - time.monotonic())
            self._flush = asyncio.create_task(self._write_progress(wait), name=f"progress-{self._task.task_id[:8]}")
            _writes.add(self._flush)
            self._flush.add_done_callback(_writes.discard)

    async def _write_progress(self, wait: float) -> None:
        if wait:
            await asyncio.sleep(wait)
        text, self._noted = self._noted, None
        if text is None:
            return
        self._noted_at = time.monotonic()
        with contextlib.suppress(Exception):  # best effort, as progress is; fenced by the lease
            await self._store.note_progress(self._task, self._owner, text[:MAX_STATUS_CHARS])

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

    async def remember(self, note: dict[str, Any]) -> None:
        """Keep the run's note with the task (fenced: a lost lease stops the run, as for a question)."""
        if not await self._store.remember(self._task, self._owner, note):
            raise asyncio.CancelledError  # cancelled or lease lost under us

    async def recall(self) -> dict[str, Any] | None:
        return await self._store.recall(self._task.tenant_id, self._task.task_id)

    async def cancelled(self) -> bool:
        """Whether the task ended (cancelled, or gone), not merely left this runner; unknown (the
        database does not answer) counts as not: the task may go on elsewhere."""
        try:
            state = await asyncio.wait_for(self._store.lease_state(self._task.tenant_id, self._task.task_id), 5)
        except Exception:
            return False
        return state is None or state.status is TaskStatus.CANCELLED

    async def ask(self, question: PendingInput) -> InputResponse:
        """Store the question (input_required), wait for its answer; the answer makes it working
        again. No answer within the input timeout fails the call (MCP_TASKS_INPUT_TIMEOUT_S)."""
        t = self._task
        async with self._hub.subscribe(("task", t.tenant_id, t.task_id)) as events:
            if not await self._store.ask(t, self._owner, question):
                raise asyncio.CancelledError  # cancelled or lease lost under us
            tracing.event("task.input_required", kind=question.kind.value)
            # Waiting is not running: the slot goes back meanwhile, and is taken again (in turn,
            # under the tenant's share) before the tool goes on, answered or not.
            released = self._waits is not None and self._waits.waiting()
            try:
                answer = await self._answer(question, events)
                tracing.event("task.input_answered", kind=question.kind.value)
                return answer
            except asyncio.CancelledError:
                released = False
                raise
            finally:
                if released:
                    assert self._waits is not None
                    await self._waits.resuming()

    async def _answer(self, question: PendingInput, events: asyncio.Queue[Any]) -> InputResponse:
        """The answer, read when an event about the task arrives or every poll; no answer within
        the input timeout fails the call."""
        t = self._task
        give_up = time.monotonic() + self._input_timeout_s
        while True:
            response = await self._store.response(t.tenant_id, t.task_id, question.key)
            if response is not None:
                return response
            left = give_up - time.monotonic()
            if left <= 0:
                metrics.labelled(metrics.task_limit_failures, t.tool, "input").inc()
                raise refused(
                    FailureReason.INPUT_TIMEOUT,
                    f"No answer to the task's question came within {self._input_timeout_s:g} s "
                    "(MCP_TASKS_INPUT_TIMEOUT_S): the task stopped waiting. Start it again and answer "
                    "when it asks.",
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(events.get(), timeout=min(self._poll_s, left))


class TaskRunContext(ToolContextBase):
    """The context of a task a runner claimed: everything goes through its TaskSink."""

    def __init__(self, task: Task, sink: TaskSink, client_capabilities: dict[str, Any] | None = None) -> None:
        """``client_capabilities``: what the task's client declared, when the task row does not
        carry it (a session's task: the session's, read when the run began)."""
        super().__init__(
            task_id=task.task_id,
            progress_token=task.progress_token,
            client_capabilities=task.client_capabilities if client_capabilities is None else client_capabilities,
            caller=(task.tenant_id, task.subject),
        )
        self._sink = sink
        self._attempts = task.attempts
        self._recalled = False
        self.ending = False  # its runner stops it and fails the task (the runtime limit)

    async def _emit(self, event: TaskEvent) -> None:
        await self._sink.emit(event)

    def _progress_status(self) -> ProgressNote | None:
        return self._sink.progress_status

    async def _ask(self, question: PendingInput) -> InputResponse:
        return await self._sink.ask(question)

    async def status(self, message: str) -> None:
        self._sink.note_status(message)

    @property
    def durable(self) -> bool:
        return True

    async def remember(self, note: dict[str, Any]) -> None:
        await self._sink.remember(note)
        self._note = note

    async def recall(self) -> dict[str, Any] | None:
        """A first run has no note but its own (no read); a later one reads what the last left."""
        if self._note is None and not self._recalled and self._attempts > 1:
            self._note = await self._sink.recall()
        self._recalled = True
        return self._note

    async def cancelled(self) -> bool:
        """Also when the run was stopped for good (its runtime limit): no other run follows it."""
        return self.ending or await self._sink.cancelled()
