"""A call of an upstream tool that the upstream runs as a task of its own (2025-11-25 Tasks): the
upstream task is created once, its id kept with our task (``ToolContext.remember``), and followed
(``tasks/get`` at its ``pollInterval``, ``tasks/result`` when it is done or asks for input). A
runner that takes our task over after a crash finds the id and follows the same upstream task
instead of calling again; our cancel, or a timeout, cancels the upstream task.

Whether another of our processes can reach the upstream task depends on the upstream's binding:
one bound to its client's credentials (ours, the same everywhere) can be followed; one bound to the
MCP session (the SDK's in-memory store) cannot, and the task then fails saying so (or, for an
upstream marked ``rerunnable``, calls again).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import pydantic
from mcp import types
from mcp.shared.exceptions import McpError

from service.observability import tracing
from service.tools.api import ToolContext
from service.upstream.calls import RESULT_KEYS, SESSION_TERMINATED, CallAsker, UpstreamFailure, following
from service.upstream.config import UpstreamConfig
from service.upstream.connection import Connection, describe

TERMINAL: Final = frozenset({"completed", "failed", "cancelled"})
POLL_BOUNDS_S: Final = (0.1, 10.0)
R = TypeVar("R")
M = TypeVar("M", bound=pydantic.BaseModel)
Sent = Callable[[dict[str, Any]], Awaitable[R]]  # sends one request, with the ``_meta`` given


def runs_as_task(conn: Connection, tool: types.Tool | None) -> bool:
    """Whether the upstream takes calls of this tool as tasks (its capability and the tool's own)."""
    info = conn.server_info
    tasks = info.capabilities.tasks if info is not None else None
    requests = tasks.requests if tasks is not None else None
    calls = requests.tools if requests is not None else None
    support = tool.execution.taskSupport if tool is not None and tool.execution is not None else None
    return calls is not None and calls.call is not None and support in ("optional", "required")


class TaskCall:
    """One of our calls following one upstream task over ``conn``."""

    def __init__(self, conn: Connection, config: UpstreamConfig, tool: str, ctx: ToolContext) -> None:
        assert conn.session is not None
        self.session = conn.session
        self.conn = conn
        self.config = config
        self.tool = tool
        self.ctx = ctx
        self.label = f"upstream {config.name!r} (tool {tool!r})"
        self.loop = asyncio.get_running_loop()
        self.asker = CallAsker(ctx, self.loop)
        self.started = self.loop.time()
        self.reported = 0
        self.last_message: str | None = None

    async def run(self, arguments: dict[str, Any], note: dict[str, Any] | None) -> dict[str, Any]:
        self.conn.askers[id(self)] = self.asker  # its questions (while tasks/result waits) are this call's
        try:
            task_id = await self._task_of(arguments, note)
            return await following(self.ctx, task_id, self._follow(task_id), self._cancel)
        finally:
            self.conn.askers.pop(id(self), None)
            self.asker.end()

    async def _task_of(self, arguments: dict[str, Any], note: dict[str, Any] | None) -> str:
        """The upstream task: the one a run before this one created, or a new one."""
        name = self.config.name
        if note is not None and isinstance(note.get("upstream_task"), str):
            task_id: str = note["upstream_task"]
            try:
                await self._request("tasks/get", self._get(task_id))
                return task_id
            except UpstreamFailure:
                if not self.config.rerunnable:
                    raise UpstreamFailure(
                        f"{self.label}: our process stopped while it followed the upstream's task {task_id}, and "
                        "that task cannot be reached from another session (the upstream binds its tasks to the MCP "
                        "session, not to our credentials): it may still run there. Start the task again.",
                        breaks=False,
                    ) from None
        elif note is not None and note.get("phase") == "creating" and not self.config.rerunnable:
            raise UpstreamFailure(
                f"{self.label}: our process stopped while it created the upstream's task, which may have "
                "started there. Start the task again.",
                breaks=False,
            )
        await self.ctx.remember({"upstream": name, "phase": "creating"})
        ttl = int(min(self.config.timeout_s * 1000 + 60_000, 2**31 - 1))
        try:
            created = await self._request(
                "tools/call",
                lambda meta: self.session.experimental.call_tool_as_task(
                    self.tool, arguments, ttl=ttl, meta=meta or None
                ),
            )
        except UpstreamFailure as exc:
            if exc.stale:  # it never reached the tool (a session the upstream dropped): may be made anew
                await self.ctx.remember({"upstream": name, "phase": "unsent"})
            raise
        task_id = created.task.taskId
        try:
            await self.ctx.remember({"upstream": name, "upstream_task": task_id})
        except BaseException:  # not kept (our lease went): nobody could follow it, so it stops
            await self._cancel(task_id)
            raise
        return task_id

    async def _follow(self, task_id: str) -> dict[str, Any]:
        while True:
            task = await self._request("tasks/get", self._get(task_id))
            await self._relay(task.statusMessage)
            if task.status == "cancelled":
                raise UpstreamFailure(f"{self.label}: the upstream cancelled its task {task_id}", breaks=False)
            if task.status in TERMINAL or task.status == "input_required":
                # tasks/result waits for the end, and carries the upstream's questions meanwhile
                answer = await self._request("tasks/result", self._result_of(task_id), waiting=True)
                wire = answer.model_dump(by_alias=True, exclude_none=True, mode="json")
                return {k: wire[k] for k in RESULT_KEYS if k in wire}
            low, high = POLL_BOUNDS_S
            await asyncio.sleep(min(high, max(low, (task.pollInterval or 1000) / 1000)))

    async def _relay(self, message: str | None) -> None:
        """A changed status message of the upstream task is ours, and progress to whoever asked for it."""
        if message and message != self.last_message:
            self.last_message = message
            self.reported += 1
            await self.ctx.status(message)
            await self.ctx.progress(self.reported, None, message)

    def _get(self, task_id: str) -> Sent[types.GetTaskResult]:
        return self._about(types.GetTaskRequest, types.GetTaskRequestParams, types.GetTaskResult, task_id)

    def _result_of(self, task_id: str) -> Sent[types.CallToolResult]:
        return self._about(
            types.GetTaskPayloadRequest, types.GetTaskPayloadRequestParams, types.CallToolResult, task_id
        )

    def _about(self, request: type[Any], params: type[pydantic.BaseModel], result: type[M], task_id: str) -> Sent[M]:
        """Sends a ``request`` (tasks/get, tasks/result, tasks/cancel) about ``task_id``."""
        return lambda meta: self.session.send_request(
            types.ClientRequest(request(params=params.model_validate(_params(task_id, meta)))), result
        )

    async def _request(self, method: str, send: Sent[R], *, waiting: bool = False) -> R:
        """One request of the follow (a client span while tracing is on, its context in the
        request's ``_meta``), bounded by ``idle_timeout_s`` (``waiting``: a tasks/result, by
        ``timeout_s`` only) and by what is left of ``timeout_s``; an upstream failure otherwise."""
        name = f"{method} {self.tool}" if method == "tools/call" else method
        with tracing.client_span(name, {"mcp.method.name": method, "gen_ai.tool.name": self.tool,
                                        "mcp_tasks.upstream": self.config.name}):  # fmt: skip
            meta: dict[str, Any] = {}
            tracing.inject(meta)
            try:
                return await self._bounded(send(meta), waiting)
            except Exception:  # the upstream's failure, or the question our client could not answer
                tracing.failed("upstream")
                raise

    async def _bounded(self, request: Awaitable[R], waiting: bool) -> R:
        left = self.started + self.config.timeout_s - self.loop.time()
        limit = left if waiting else min(left, self.config.idle_timeout_s)
        try:
            return await asyncio.wait_for(request, max(0.0, limit))
        except TimeoutError:
            which = "timeout_s" if waiting or left <= self.config.idle_timeout_s else "idle_timeout_s"
            value = self.config.timeout_s if which == "timeout_s" else self.config.idle_timeout_s
            # (timeout_s is the call's own bound, as for a plain call: not the upstream's failure)
            raise UpstreamFailure(f"{self.label} did not answer within {which}={value:g} s",
                                  breaks=which == "idle_timeout_s") from None  # fmt: skip
        except McpError as exc:
            if self.asker.failure is not None:
                raise self.asker.failure from None
            if exc.error.code == types.CONNECTION_CLOSED:
                raise UpstreamFailure(f"{self.label} closed the connection", breaks=True, lost=True) from None
            if exc.error.code == SESSION_TERMINATED:  # a reused session it dropped: tried again anew
                raise UpstreamFailure(f"{self.label} no longer knows our session", breaks=False, lost=True,
                                      stale=True) from None  # fmt: skip
            raise UpstreamFailure(
                f"{self.label} answered with error {exc.error.code}: {exc.error.message[:500]}", breaks=False
            ) from None
        except pydantic.ValidationError:
            raise UpstreamFailure(f"{self.label} answered with something that is not MCP", breaks=True) from None
        except (asyncio.CancelledError, UpstreamFailure):
            raise
        except Exception as exc:
            raise UpstreamFailure(f"{self.label} could not be followed: {describe(exc)}", breaks=True) from None

    async def _cancel(self, task_id: str) -> None:
        """We stopped following: the upstream task stops too (best effort, bounded)."""
        with contextlib.suppress(Exception), tracing.client_span("tasks/cancel", {"mcp.method.name": "tasks/cancel",
                                                                                "mcp_tasks.upstream": self.config.name}):  # fmt: skip
            meta: dict[str, Any] = {}
            tracing.inject(meta)
            send = self._about(types.CancelTaskRequest, types.CancelTaskRequestParams, types.CancelTaskResult, task_id)
            await asyncio.wait_for(asyncio.shield(send(meta)), 2)


def _params(task_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    """A task request's params: the task id, and the trace context in ``_meta`` when there is one."""
    return {"taskId": task_id, **({"_meta": meta} if meta else {})}
