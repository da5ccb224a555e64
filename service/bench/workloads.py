"""The workloads: what one operation is, what is set up before measuring, and what is cleaned up after.

Four on the 2025-11-25 wire (``plain``, ``lifecycle``, ``get``, ``create``) and two on the
2026-07-28 Tasks extension (``ext-lifecycle``, ``ext-get``); the session a client holds speaks the
wire of its workload (``service.bench.wire`` or ``service.bench.v2026``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Final

from service.bench.stats import (
    Check,
    Recorder,
    created_task,
    ext_created_task,
    ext_held_task,
    ext_task_until_done,
    tool_result,
)
from service.bench.wire import RequestFailed, Session
from service.domain.values import frozen

HOLD_SECONDS: Final = 3600
# An ext lifecycle whose task is not completed within this long counts as failed (kind task_timeout).
EXT_LIFECYCLE_TIMEOUT_S: Final = 30.0
EXT_WORKLOADS: Final = frozenset({"ext-lifecycle", "ext-get"})


@dataclass(slots=True)
class Client:
    """One simulated client: its session and the tasks it must cancel before leaving."""

    session: Session
    rng: random.Random
    held: list[str] = field(default_factory=list)


@frozen
class Workload:
    """Prebuilt request parameters, so an operation allocates no more than the wire needs."""

    name: str
    plain_call: dict[str, Any]
    task_call: dict[str, Any]
    hold_call: dict[str, Any]
    # The 2026-07-28 calls carry no params.task (ignored there, X-NEG-9): the server decides.
    ext_task_call: dict[str, Any] = field(default_factory=dict)
    ext_hold_call: dict[str, Any] = field(default_factory=dict)
    ext_done: Check = tool_result
    ext_poll_s: float = 0.005

    @classmethod
    def build(
        cls, name: str, tool: str, hold_tool: str, ttl_ms: int, *, task_seconds: float = 0.005, poll_ms: float = 5.0
    ) -> Workload:
        task = {"ttl": ttl_ms}
        return cls(
            name=name,
            plain_call={"name": tool, "arguments": {"text": "x"}},
            task_call={"name": tool, "arguments": {"text": "x"}, "task": task},
            hold_call={"name": hold_tool, "arguments": {"seconds": HOLD_SECONDS}, "task": task},
            ext_task_call={"name": hold_tool, "arguments": {"seconds": task_seconds}},
            ext_hold_call={"name": hold_tool, "arguments": {"seconds": HOLD_SECONDS}},
            # What a demo `sleep` answers, ours and the peers' alike.
            ext_done=ext_task_until_done(f"slept {task_seconds:g}s"),
            ext_poll_s=poll_ms / 1000,
        )

    def operation(self) -> Callable[[Client, Recorder], Awaitable[bool]]:
        return {
            "plain": self.plain,
            "lifecycle": self.lifecycle,
            "get": self.get,
            "create": self.create,
            "ext-lifecycle": self.ext_lifecycle,
            "ext-get": self.ext_get,
        }[self.name]

    async def plain(self, client: Client, rec: Recorder) -> bool:
        return await rec.call(client.session, "tools/call", self.plain_call, tool_result) is not None

    async def lifecycle(self, client: Client, rec: Recorder) -> bool:
        created = await rec.call(client.session, "tools/call", self.task_call, created_task)
        if created is None:
            return False
        task_id = {"taskId": created["task"]["taskId"]}
        if await rec.call(client.session, "tasks/get", task_id) is None:
            return False
        # tasks/result blocks until the task is terminal and returns what the call would have returned.
        return await rec.call(client.session, "tasks/result", task_id, tool_result) is not None

    async def get(self, client: Client, rec: Recorder) -> bool:
        task_id = {"taskId": client.rng.choice(client.held)}
        return await rec.call(client.session, "tasks/get", task_id) is not None

    async def create(self, client: Client, rec: Recorder) -> bool:
        created = await rec.call(client.session, "tools/call", self.hold_call, created_task)
        if created is None:
            return False
        client.held.append(created["task"]["taskId"])
        return True

    async def ext_lifecycle(self, client: Client, rec: Recorder) -> bool:
        """tools/call -> a task -> tasks/get at once, then every ``ext_poll_s`` until ``completed``
        with the tool's result inline: one lifecycle per completed task."""
        created = await rec.call(client.session, "tools/call", self.ext_task_call, ext_created_task)
        if created is None:
            return False
        task_id = {"taskId": created["taskId"]}
        deadline = perf_counter() + EXT_LIFECYCLE_TIMEOUT_S
        while True:
            task = await rec.call(client.session, "tasks/get", task_id, self.ext_done)
            if task is None:
                return False
            if task["status"] == "completed":
                return True
            if perf_counter() > deadline:
                rec.fail("tasks/get", "task_timeout")
                return False
            await asyncio.sleep(self.ext_poll_s)

    async def ext_get(self, client: Client, rec: Recorder) -> bool:
        held = client.rng.choice(client.held)
        return await rec.call(client.session, "tasks/get", {"taskId": held}, ext_held_task(held)) is not None

    async def ext_create(self, client: Client, rec: Recorder) -> bool:
        created = await rec.call(client.session, "tools/call", self.ext_hold_call, ext_created_task)
        if created is None:
            return False
        client.held.append(created["taskId"])
        return True

    async def hold(self, client: Client, count: int, rec: Recorder, progress: Callable[[], None]) -> None:
        """Setup of ``get`` and ``ext-get``: create ``count`` long tasks that stay pending while measuring."""
        create = self.ext_create if self.name in EXT_WORKLOADS else self.create
        for _ in range(count):
            started = perf_counter()
            ok = await create(client, rec)
            rec.op_done(ok, perf_counter() - started)
            progress()


async def run_op(op: Callable[[Client, Recorder], Awaitable[bool]], client: Client, rec: Recorder) -> None:
    started = perf_counter()
    ok = await op(client, rec)
    rec.op_done(ok, perf_counter() - started)


@dataclass(slots=True)
class Cleanup:
    """How the best-effort cancellation of held tasks went (never part of the measurement)."""

    cancelled: int = 0
    failed: int = 0
    left: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"cancelled": self.cancelled, "failed": self.failed, "left": self.left}


async def cancel_held(clients: list[Client], budget_s: float) -> Cleanup:
    """Cancel every client's held tasks within ``budget_s``; what is left expires with its TTL."""
    outcome = Cleanup()

    async def cancel_own(client: Client) -> None:
        # Each client cancels through its own session: some servers bind tasks to the creating session.
        while client.held:
            try:
                await client.session.request("tasks/cancel", {"taskId": client.held[-1]})
                outcome.cancelled += 1
            except RequestFailed:
                outcome.failed += 1
            # Popped only now: a task whose cancel the budget interrupted is still counted as left.
            client.held.pop()

    try:
        async with asyncio.timeout(budget_s):
            await asyncio.gather(*(cancel_own(c) for c in clients))
    except TimeoutError:
        pass
    outcome.left = sum(len(c.held) for c in clients)
    return outcome
