"""What the use cases (``service.tasks``) ask of the runtime: run a tool, or take over a task.

``Engine`` is the runtime's one face. It starts plain calls and calls inside their request (the
executor), and when this process runs tasks it hands the runner the tasks this process creates
straight to a free slot: ``reserve`` a slot before the create, then ``adopt`` the create's
outcome, or ``hand_over`` a call already running and ``adopt_call`` it once its task is written.
Each adoption is settled once the create's answer is known, whoever still waits for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from service.domain.events import TaskEvent
from service.domain.inputs import InputResponse
from service.domain.task import Outcome, Task
from service.domain.values import frozen
from service.runtime.commands import Reservation
from service.runtime.executor import Executor
from service.runtime.inline import InlineCall, InlineCallContext, RoundResult, ask_first
from service.runtime.runner import Runner
from service.store.requests import Lease
from service.tools.api import ToolContext
from service.tools.registry import Registry


@frozen
class Slot:
    """A slot of this process's runner, reserved for the create of ``task_id`` under ``lease``."""

    reservation: Reservation
    lease: Lease
    task_id: str


class Engine:
    def __init__(self, executor: Executor, runner: Runner | None) -> None:
        self.executor = executor
        self.runner = runner

    @property
    def registry(self) -> Registry:
        return self.executor.registry

    @property
    def runs_tasks(self) -> bool:
        """Whether this process runs tasks (a call may then become a task where it runs)."""
        return self.runner is not None

    def start_plain(self, tool: str, arguments: dict[str, Any], ctx: ToolContext) -> asyncio.Future[Outcome]:
        return self.executor.start(tool, arguments, ctx)

    def start_call(
        self, tool: str, arguments: dict[str, Any], *, responses: dict[str, InputResponse],
        progress_token: str | int | None, client_capabilities: dict[str, Any],
        on_event: Callable[[TaskEvent], None] | None = None, caller: tuple[str, str] | None = None,
        may_become_task: bool = False,
    ) -> InlineCall:  # fmt: skip
        return self.executor.start_call(tool, arguments, responses=responses, progress_token=progress_token,
                                        client_capabilities=client_capabilities, on_event=on_event,
                                        caller=caller, may_become_task=may_become_task)  # fmt: skip

    @staticmethod
    async def ask_first(
        work: Callable[[InlineCallContext], Awaitable[Any]], *, responses: dict[str, InputResponse],
        client_capabilities: dict[str, Any],
    ) -> RoundResult[Any]:  # fmt: skip
        """Something that is not a tool call (a prompt) that may ask the client first."""
        return await ask_first(work, responses=responses, client_capabilities=client_capabilities)

    def reserve(self, tenant_id: str, task_id: str) -> Slot | None:
        """A free slot of this process's runner for the task about to be created, if there is one."""
        if self.runner is None:
            return None
        reservation = self.runner.reserve(tenant_id)
        return Slot(reservation, self.runner.lease(), task_id) if reservation is not None else None

    def adopt(self, slot: Slot, created: asyncio.Future[Task | None], capabilities: dict[str, Any] | None) -> None:
        """Once the create under ``slot`` is answered, the runner runs its task (or looks it up
        when the answer was lost: the statement may have committed)."""
        runner = self.runner
        assert runner is not None

        def settle(future: asyncio.Future[Task | None]) -> None:
            if future.cancelled() or future.exception() is not None:
                runner.answer_lost(slot.reservation, slot.task_id)
            else:
                runner.adopt(slot.reservation, future.result(), capabilities)

        created.add_done_callback(settle)

    def hand_over(self, call: InlineCall, slot: Slot) -> Slot | None:
        """The call, which held ``slot`` while it ran inside its request, becomes its task where it
        runs: the slot with a fresh lease, or None (released) when this process cannot run it now
        (shutting down, its row stale)."""
        runner = self.runner
        assert runner is not None
        call.ctx.begin_conversion()  # a question from here on waits for the task (no round to end)
        if runner.convert(slot.reservation):
            return Slot(slot.reservation, runner.lease(), slot.task_id)
        runner.adopt(slot.reservation, None)
        return None

    def reserve_call(self, tenant_id: str, task_id: str) -> Slot | None:
        """A slot of the tenant's share for a call about to run inside its request that may become
        a task (even when none is free: such a call always ran there), or None at the share."""
        if self.runner is None:
            return None
        reservation = self.runner.reserve(tenant_id, inline=True)
        return Slot(reservation, self.runner.lease(), task_id) if reservation is not None else None

    def release(self, slot: Slot) -> None:
        """A slot reserved for a call that ended inside its request, or never started: free again."""
        assert self.runner is not None
        self.runner.adopt(slot.reservation, None)

    def adopt_call(self, slot: Slot, call: InlineCall, created: asyncio.Future[Task | None]) -> None:
        """Once the call's task is written, the runner goes on awaiting the call as that task
        (never started twice); the call stops when nothing was written."""
        runner = self.runner
        assert runner is not None

        def settle(future: asyncio.Future[Task | None]) -> None:
            if future.cancelled() or future.exception() is not None:
                call.cancel()
                runner.answer_lost(slot.reservation, slot.task_id)  # it may exist: the runner looks
            elif (task := future.result()) is None:
                call.cancel()
                runner.adopt(slot.reservation, None)  # a cap refused it: nothing was written
            else:
                runner.adopt_call(slot.reservation, task, call)

        created.add_done_callback(settle)
