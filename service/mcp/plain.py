"""Plain (non-task) tools/call: in-flight registry, cancellation, and the tool's context."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

from service.domain.events import InputRequested, TaskEvent
from service.domain.inputs import InputResponse, PendingInput
from service.domain.task import FailureReason
from service.tasks.signals import Signals
from service.tools.api import refused
from service.tools.context import ToolContextBase

# A plain call that asked the client for input gives up after this long without an answer.
PLAIN_INPUT_TIMEOUT_S = 600.0

CallKey = tuple[str, str, str]  # (tenant, session, repr of the request id)
AnswerKey = tuple[str, str, str]  # (tenant, subject, question key): T-INPUT-7


class Inflight:
    """Plain calls running in this process, and their outstanding questions to the client."""

    def __init__(self, signals: Signals, *, input_timeout_s: float = PLAIN_INPUT_TIMEOUT_S) -> None:
        self.signals = signals
        self.input_timeout_s = input_timeout_s
        # Requests in flight here that notifications/cancelled may stop: key -> how to stop it.
        self.calls: dict[CallKey, Callable[[], object]] = {}
        self.pending: dict[AnswerKey, asyncio.Future[InputResponse]] = {}
        signals.listen(
            lambda tenant, subject, key, response: self.resolve_local((tenant, subject, key), response),
            lambda tenant, session, request: self.cancel_local((tenant, session, request)),
        )

    def resolve_local(self, key: AnswerKey, response: InputResponse) -> bool:
        fut = self.pending.get(key)
        if fut is None or fut.done():
            return False
        fut.set_result(response)
        return True

    def cancel_local(self, key: CallKey) -> bool:
        stop = self.calls.get(key)
        if stop is None:
            return False
        stop()
        return True

    def abandon(self, key: CallKey, grace_s: float) -> None:
        """The client of this plain call went away: stop it after ``grace_s`` unless it ended."""
        stop = self.calls.get(key)
        if stop is None:
            return

        def expire() -> None:
            if self.calls.get(key) is stop:  # the same call, still running
                stop()

        asyncio.get_running_loop().call_later(grace_s, expire)

    async def answer(self, tenant: str, subject: str, key: str, response: InputResponse) -> None:
        if not self.resolve_local((tenant, subject, key), response):
            await self.signals.answer(tenant, subject, key, response)

    async def cancel(self, key: CallKey) -> None:
        """C-4: stop a plain request, here or on whichever replica runs it."""
        if not self.cancel_local(key):
            await self.signals.cancel(*key)


class Outbox:
    """The events a plain call's tool sends before its result, for one reader at a time;
    ``first`` resolves on the first. Not an asyncio.Queue: a call makes one, and most calls send
    nothing (the queue's getters, putters, event and counters cost more than the call's answer).
    ``first`` is made when asked for: a call that ends in its first step never waits on it."""

    __slots__ = ("_first", "_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[TaskEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._first: asyncio.Future[None] | None = None

    @property
    def first(self) -> asyncio.Future[None]:
        if self._first is None:
            self._first = asyncio.get_running_loop().create_future()
            if self._items:
                self._first.set_result(None)
        return self._first

    def put_nowait(self, item: TaskEvent) -> None:
        self._items.append(item)
        if (waiter := self._waiter) is not None and not waiter.done():
            waiter.set_result(None)
        self.wake()

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> TaskEvent:
        return self._items.popleft()  # IndexError when empty: callers look with empty() first

    async def get(self) -> TaskEvent:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def wake(self, _: object = None) -> None:
        if self._first is not None and not self._first.done():
            self._first.set_result(None)


async def first_of(job: asyncio.Future[Any], outbox: Outbox) -> None:
    """Wait until the job ends or sends its first event: plain futures, no helper task."""
    if job.done() or not outbox.empty():
        return
    job.add_done_callback(outbox.wake)
    await outbox.first


class PlainCallContext(ToolContextBase):
    """A tool running inside its own tools/call request: its events go on that request's stream."""

    def __init__(
        self,
        inflight: Inflight,
        owner: tuple[str, str],
        outbox: Outbox,
        *,
        progress_token: str | int | None,
        client_capabilities: dict[str, Any],
    ) -> None:
        super().__init__(
            task_id=None, progress_token=progress_token, client_capabilities=client_capabilities, caller=owner
        )
        self._inflight = inflight
        self._owner = owner
        self._outbox = outbox

    async def _emit(self, event: TaskEvent) -> None:
        self._outbox.put_nowait(event)

    async def _ask(self, question: PendingInput) -> InputResponse:
        fut: asyncio.Future[InputResponse] = asyncio.get_running_loop().create_future()
        key = (*self._owner, question.key)
        self._inflight.pending[key] = fut
        try:
            self._outbox.put_nowait(InputRequested(None, question))
            try:
                return await asyncio.wait_for(fut, timeout=self._inflight.input_timeout_s)
            except TimeoutError:
                raise refused(
                    FailureReason.INPUT_TIMEOUT,
                    f"no answer from the client within {self._inflight.input_timeout_s:g} s: the call stopped waiting",
                ) from None
        finally:
            self._inflight.pending.pop(key, None)
            if not fut.done():
                with contextlib.suppress(Exception):
                    fut.cancel()
