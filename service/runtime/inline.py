"""A call that starts inside its request and may become a task (the 2026-07-28 way, XD-5).

The tool runs at once. While it runs inside the request its questions are answered from the
answers the request brought (multi-round-trip requests: the client retries the call with
``inputResponses``), keyed by the order in which the run asks them; a question with no answer ends
the round, and the client retries with it answered (the tool runs again from the start). Once the
call has run longer than its grace, or once a call that must be a task gets past its answered
questions, it becomes a task: its row is committed, the runner adopts the running job, and from
then on its events and questions go through the task (new, random keys: X-CREATE-5).
The call is started by the executor (``executor.py``) and handed over by the engine (``engine.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from service.domain.events import TaskEvent
from service.domain.inputs import InputResponse, PendingInput, check_response
from service.domain.task import FailureReason, Outcome
from service.domain.values import frozen
from service.tools.api import refused
from service.tools.context import ProgressNote, ToolContextBase

T = TypeVar("T")


class Sink(Protocol):
    progress_status: ProgressNote | None

    async def emit(self, event: TaskEvent) -> None: ...

    async def ask(self, question: PendingInput) -> InputResponse: ...

    async def remember(self, note: dict[str, Any]) -> None: ...

    async def cancelled(self) -> bool: ...

    def note_status(self, text: str) -> None: ...


class InlineCallContext(ToolContextBase):
    """The context of a call running inside its request, until it becomes a task."""

    def __init__(
        self,
        *,
        responses: dict[str, InputResponse],
        progress_token: str | int | None,
        client_capabilities: dict[str, Any],
        on_event: Callable[[TaskEvent], None] | None = None,
        caller: tuple[str, str] | None = None,
        replays: bool = True,
        may_become_task: bool = False,
    ) -> None:
        super().__init__(
            task_id=None, progress_token=progress_token, client_capabilities=client_capabilities, caller=caller
        )
        self._on_event = on_event
        self._responses = responses
        self._asked = 0
        self._sink: Sink | None = None
        # Between "this call becomes a task" and the runner attaching it, a question must wait for
        # the task rather than end a round nobody is waiting on any more.
        self._converting = False
        self._attached = asyncio.Event()
        # Questions of this round with no answer in the request: the round ends with them.
        self.unanswered: list[PendingInput] = []
        self.asked_unanswered = asyncio.Event()
        # The keys whose answers the run took: only those travel on in the next round's requestState.
        self.used: set[str] = set()
        # A tool that cannot be run again (``ToolSpec.replays``) asks as a task: set when it wants to.
        self._replays = replays
        self._may_become_task = may_become_task
        self.wants_task = asyncio.Event()
        self._note_written: asyncio.Future[None] | None = None  # a note kept before the call became a task

    def begin_conversion(self) -> None:
        """The call is about to become a task: questions from now on wait for it, and its progress
        no longer goes to the request's stream (it ends with the task's creation; no progress
        notifications for tasks, X-NOTIF-8): once attached, it becomes the task's status message."""
        self._converting = True
        self._token = None

    def attach(self, task_id: str, sink: Sink) -> None:
        """The call became a task: events, questions and notes go through it from now on (a note
        kept before goes with the task now)."""
        self._task_id = task_id
        self._sink = sink
        self._attached.set()
        if self._note is not None:
            self._note_written = asyncio.ensure_future(sink.remember(self._note))
            # a lease lost meanwhile stops the run anyway; the outcome of this write is not awaited
            self._note_written.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def durable(self) -> bool:
        return self._sink is not None

    async def remember(self, note: dict[str, Any]) -> None:
        self._note = note
        if self._sink is not None:
            if self._note_written is not None:  # the note kept before the conversion lands first
                await asyncio.wait({self._note_written})
            await self._sink.remember(note)

    async def cancelled(self) -> bool:
        return await self._sink.cancelled() if self._sink is not None else True

    async def status(self, message: str) -> None:
        if self._sink is not None:
            self._sink.note_status(message)

    def _progress_status(self) -> ProgressNote | None:
        """Once the call is a task, its progress goes to the task's status (as a task run's does)."""
        return self._sink.progress_status if self._sink is not None else None

    def _next_key(self, wanted: str | None) -> str:
        if self._sink is not None or self._converting or not self._replays:
            return super()._next_key(wanted)  # a task's keys are the service's: unique for its life
        self._asked += 1
        # The same question gets the same key when the run is retried: the tool's name for it, or
        # its place in the run.
        return wanted or f"q{self._asked}"

    async def _emit(self, event: TaskEvent) -> None:
        if self._sink is not None:
            await self._sink.emit(event)
        elif self._on_event is not None:  # inside the request: on its own stream (XD-18)
            self._on_event(event)

    async def _ask(self, question: PendingInput) -> InputResponse:
        if self._sink is None and not self._converting and not self._replays:
            if not self._may_become_task:
                raise refused(
                    FailureReason.TOOL,
                    "this tool asked for input, and a call that cannot become a task could only get the answer "
                    "by running it again: call it as a task (declare the tasks extension) to answer it",
                )
            self.wants_task.set()  # the round ends as running: the call becomes a task, then asks
            await self._attached.wait()
        if self._sink is None and self._converting:
            await self._attached.wait()  # the create failing cancels the job instead
        if self._sink is not None:
            return await self._sink.ask(question)
        response = self._responses.get(question.key)
        if response is not None:
            try:
                check_response(question.kind, response)
            except Exception as exc:
                raise refused(FailureReason.INVALID_INPUT, f"inputResponses[{question.key!r}]: {exc}") from None
            self.used.add(question.key)
            return response
        self.unanswered.append(question)
        self.asked_unanswered.set()
        await asyncio.Event().wait()  # the round ends here; the request cancels the run
        raise AssertionError("unreachable")


class InlineCall:
    """A call running inside its request: its rounds, then, if it becomes a task, its hand-over
    to the runner (``Engine.hand_over``)."""

    def __init__(self, job: asyncio.Future[Outcome], ctx: InlineCallContext) -> None:
        self.job = job
        self.ctx = ctx

    async def round(self, grace_s: float | None) -> RoundResult[Outcome]:
        """The call's first end (see ``run_round``); the request going away cancels the call (X-HTTP-7)."""
        try:
            return await run_round(self.job, self.ctx, grace_s=grace_s)
        except BaseException:
            self.job.cancel()
            raise

    def cancel(self) -> None:
        self.job.cancel()

    def attach(self, task_id: str, sink: Sink) -> None:
        """The call became that task: its events and questions go through the task from now on."""
        self.ctx.attach(task_id, sink)


class CallEnd(enum.Enum):
    DONE = "done"
    NEEDS_INPUT = "needs_input"
    RUNNING = "running"


@frozen
class RoundResult(Generic[T]):
    end: CallEnd
    outcome: T | None = None
    questions: tuple[PendingInput, ...] = ()
    used: frozenset[str] = frozenset()  # with questions: the answered keys the run took


async def run_round(job: asyncio.Future[T], ctx: InlineCallContext, *, grace_s: float | None) -> RoundResult[T]:
    """Wait for the call's first end: done, a question without an answer (the job is cancelled),
    or still running after ``grace_s`` (None: no grace; wait for the other two) or sooner, when a
    tool that cannot be run again wants to ask (as the task the call becomes)."""
    asking: asyncio.Future[Any] = asyncio.ensure_future(ctx.asked_unanswered.wait())
    wanting: asyncio.Future[Any] = asyncio.ensure_future(ctx.wants_task.wait())
    waiting: set[asyncio.Future[Any]] = {job, asking, wanting}
    try:
        await asyncio.wait(waiting, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        asking.cancel()
        wanting.cancel()
    if ctx.unanswered:
        # Questions asked together (asyncio.gather) reach us one loop turn apart: collect them all.
        for _ in range(5):
            await asyncio.sleep(0)
        job.cancel()
        with contextlib.suppress(BaseException):
            await job
        return RoundResult(CallEnd.NEEDS_INPUT, questions=tuple(ctx.unanswered), used=frozenset(ctx.used))
    if job.done():
        return RoundResult(CallEnd.DONE, outcome=job.result())
    return RoundResult(CallEnd.RUNNING)


async def ask_first(
    work: Callable[[InlineCallContext], Awaitable[T]],
    *,
    responses: dict[str, InputResponse],
    client_capabilities: dict[str, Any],
) -> RoundResult[T]:
    """Run something that is not a tool call (a prompt) that may ask the client first: done, or
    the questions the retry must answer."""
    ctx = InlineCallContext(responses=responses, progress_token=None, client_capabilities=client_capabilities)
    job = asyncio.ensure_future(work(ctx))
    try:
        return await run_round(job, ctx, grace_s=None)
    except BaseException:
        job.cancel()
        raise
