"""An upstream MCP server with 2025-11-25 Tasks of its own, for the tests, on the official MCP Python
SDK's low-level server: its tasks outlive the MCP session that created them and belong to the
bearer token that did (as a server with authorization binds them), so any of our processes, with
the same credentials, can follow one.

    python -m tests.upstream_tasks_server PORT [--marks DIR] [--session-bound]

``--session-bound``: a task is found only from the session that created it (the SDK's default
store's binding), so after a takeover it cannot be reached. ``--marks DIR``: each run of ``work``
writes ``DIR/work-<n>.started`` and ``.finished`` (or ``.cancelled``), and each request a line
``<method> <traceparent in its _meta, or ->`` to ``DIR/requests``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import uuid
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import McpError
from starlette.applications import Starlette
from starlette.routing import Route

warnings.filterwarnings("ignore", category=DeprecationWarning)
logging.getLogger("mcp").setLevel(logging.CRITICAL)  # its session-close noise is not ours to read
parser = argparse.ArgumentParser()
parser.add_argument("port", type=int)
parser.add_argument("--marks", default=None)
parser.add_argument("--session-bound", action="store_true")
ARGS = parser.parse_args()
MARKS = Path(ARGS.marks) if ARGS.marks else None
SEQ = itertools.count(1)
POLL_MS = 200

server: Server[Any, Any] = Server("task-upstream")
server.experimental.enable_tasks()  # the tasks capability; its default handlers are replaced below
GROUP: list[anyio.abc.TaskGroup] = []


@dataclass
class Entry:
    task: types.Task
    owner: str
    done: anyio.Event = field(default_factory=anyio.Event)
    result: types.CallToolResult | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


TASKS: dict[str, Entry] = {}


def mark(n: int, what: str) -> None:
    if MARKS is not None:
        (MARKS / f"work-{n}.{what}").write_text("")


def seen(method: str, meta: types.RequestParams.Meta | None) -> None:
    """A line in ``MARKS/requests``: the method, and the trace context its ``_meta`` carried."""
    if MARKS is not None:
        traceparent = (meta.model_extra or {}).get("traceparent") if meta is not None else None
        with (MARKS / "requests").open("a") as f:
            f.write(f"{method} {traceparent or '-'}\n")


def owner() -> str:
    """Who asks: the bearer token (and, when session-bound, the MCP session too)."""
    ctx = server.request_context
    request = ctx.request
    token = request.headers.get("authorization", "") if request is not None else ""
    return f"{token}|{id(ctx.session)}" if ARGS.session_bound else token


def find(task_id: str) -> Entry:
    entry = TASKS.get(task_id)
    if entry is None or entry.owner != owner():
        raise McpError(types.ErrorData(code=types.INVALID_PARAMS, message=f"Task not found: {task_id}"))
    return entry


def now() -> datetime:
    return datetime.now(UTC)


@server.list_tools()
async def list_tools() -> list[types.Tool]:
    return [
        types.Tool(
            name="work",
            description="Work for `seconds`, saying how far it got in the task's statusMessage.",
            inputSchema={"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
            execution=types.ToolExecution(taskSupport=types.TASK_REQUIRED),
        )
    ]


async def work(entry: Entry, seconds: float) -> None:
    n = next(SEQ)
    mark(n, "started")
    steps = max(1, int(seconds / 0.2))
    with entry.scope:
        for i in range(1, steps + 1):
            await anyio.sleep(seconds / steps)
            entry.task.statusMessage = f"step {i} of {steps}"
            entry.task.lastUpdatedAt = now()
        entry.result = types.CallToolResult(content=[types.TextContent(type="text", text=f"worked {seconds:g}s")])
        entry.task.status = "completed"
        mark(n, "finished")
    if entry.scope.cancelled_caught:
        mark(n, "cancelled")
    entry.task.lastUpdatedAt = now()
    entry.done.set()


@server.call_tool()
async def call_tool(name: str, arguments: dict[str, Any]) -> Any:
    ctx = server.request_context
    seen("tools/call", ctx.meta)
    if name != "work" or not ctx.experimental.is_task:
        raise McpError(types.ErrorData(code=types.INVALID_PARAMS, message="work is a task-only tool"))
    task_id = str(uuid.uuid4())
    task = types.Task(taskId=task_id, status="working", createdAt=now(), lastUpdatedAt=now(), ttl=600_000,
                      pollInterval=POLL_MS)  # fmt: skip
    entry = TASKS[task_id] = Entry(task, owner())
    GROUP[0].start_soon(work, entry, float(arguments.get("seconds", 1)))
    return types.CreateTaskResult(task=task)


@server.experimental.get_task()
async def get_task(req: types.GetTaskRequest) -> types.GetTaskResult:
    seen("tasks/get", req.params.meta)
    return types.GetTaskResult(**find(req.params.taskId).task.model_dump())


@server.experimental.get_task_result()
async def get_task_result(req: types.GetTaskPayloadRequest) -> types.GetTaskPayloadResult:
    seen("tasks/result", req.params.meta)
    entry = find(req.params.taskId)
    await entry.done.wait()
    if entry.result is None:
        raise McpError(types.ErrorData(code=types.INTERNAL_ERROR, message="the task was cancelled"))
    return types.GetTaskPayloadResult(**entry.result.model_dump(by_alias=True, exclude_none=True))


@server.experimental.cancel_task()
async def cancel_task(req: types.CancelTaskRequest) -> types.CancelTaskResult:
    seen("tasks/cancel", req.params.meta)
    entry = find(req.params.taskId)
    if entry.task.status == "working":
        entry.task.status = "cancelled"
        entry.scope.cancel()
    return types.CancelTaskResult(**entry.task.model_dump())


def main() -> None:
    manager = StreamableHTTPSessionManager(app=server)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg, manager.run():
            GROUP.append(tg)
            yield
            tg.cancel_scope.cancel()

    class Endpoint:
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await manager.handle_request(scope, receive, send)

    app = Starlette(routes=[Route("/mcp", endpoint=Endpoint(), methods=["GET", "POST", "DELETE"])], lifespan=lifespan)
    uvicorn.run(app, host="127.0.0.1", port=ARGS.port, log_level="critical")


if __name__ == "__main__":
    main()
