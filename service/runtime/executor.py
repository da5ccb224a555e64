"""The one place that runs a tool: plain calls, calls inside their request, and task runs.

A plain call of the 2025-11-25 wire starts with ``start``: its first step runs at once, in the
caller's turn (most end in it). A call of the 2026-07-28 wire starts with ``start_call`` and runs
round by round (``inline.py``) until it ends, asks for input or, when it may become a task, is
handed over to the runner. A task's run awaits ``run``. Nothing else in the
service calls a tool (the import contracts keep ``service.tools.execute`` to the runtime).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from service.concurrency import eager
from service.domain.events import TaskEvent
from service.domain.inputs import InputResponse
from service.domain.task import Outcome
from service.runtime.inline import InlineCall, InlineCallContext
from service.tools.api import ToolContext
from service.tools.execute import run_tool
from service.tools.registry import Registry


class Executor:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def run(self, tool: str, arguments: dict[str, Any], ctx: ToolContext) -> Outcome:
        """The call's outcome; only cancellation propagates (``tools.execute.run_tool``)."""
        return await run_tool(self.registry, tool, arguments, ctx)

    def start(self, tool: str, arguments: dict[str, Any], ctx: ToolContext) -> asyncio.Future[Outcome]:
        """A plain call, its first step taken now: a future already done when that step ended it."""
        return eager.start(run_tool(self.registry, tool, arguments, ctx), name=f"call-{tool}")

    def start_call(
        self, tool: str, arguments: dict[str, Any], *, responses: dict[str, InputResponse],
        progress_token: str | int | None, client_capabilities: dict[str, Any],
        on_event: Callable[[TaskEvent], None] | None = None, caller: tuple[str, str] | None = None,
        may_become_task: bool = False,
    ) -> InlineCall:  # fmt: skip
        """A call running inside its request, its questions answered from ``responses`` until it
        becomes a task (if it does). ``caller``: (tenant, subject)."""
        spec = self.registry.tools.get(tool)
        ctx = InlineCallContext(
            responses=responses, progress_token=progress_token, client_capabilities=client_capabilities,
            on_event=on_event, caller=caller, replays=spec is None or spec.replays, may_become_task=may_become_task,
        )  # fmt: skip
        return InlineCall(asyncio.create_task(run_tool(self.registry, tool, arguments, ctx), name=f"call-{tool}"), ctx)
