"""``mcp-tasks call``: run a tool (as a task when it takes long), follow it, answer its questions at
the terminal, print its result. Exit codes and interruptions: ``service.cli_exit``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import httpx

from service.cli_exit import FAILED, OK, USAGE, CommandError, CommandState, check_url
from service.cli_history import remember
from service.client import McpClient, McpClientError, V2026Client

TERMINAL = ("completed", "failed", "cancelled")


def add_parser(sub: Any) -> None:
    call = sub.add_parser("call", help="run a tool as a task, show progress, print the result")
    call.add_argument("tool")
    call.add_argument("--arg", action="append", default=[], help="key=value, the value a string")
    call.add_argument("--json-arg", action="append", default=[], help="key=JSON, e.g. items=[1,2] or ok=true")
    call.add_argument("--url", default="http://127.0.0.1:8000/mcp")
    call.add_argument("--token", default=None)
    call.add_argument(
        "--ttl", type=int, default=600_000, help="requested TTL (2025-11-25 only; the server chooses on 2026-07-28)"
    )
    call.add_argument(
        "--wire",
        choices=["2026-07-28", "2025-11-25"],
        default="2026-07-28",
        help="protocol revision to speak (default: 2026-07-28 with the Tasks extension)",
    )


def parse_arg(raw: str, *, as_json: bool = False) -> tuple[str, Any]:
    """``--arg k=v`` (a string) or ``--json-arg k=JSON``; the tool's schema converts the string
    where it expects a number or a boolean."""
    flag = "--json-arg" if as_json else "--arg"
    key, sep, value = raw.partition("=")
    if not sep or not key:
        raise CommandError(USAGE, f"mcp-tasks: {flag} needs key=value, got {raw!r}")
    if not as_json:
        return key, value
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as exc:
        raise CommandError(
            USAGE, f"mcp-tasks: --json-arg {key}: not JSON ({exc.msg}); use --arg for a string"
        ) from None


class _Stdin:
    """Lines of stdin read on the event loop, not in a thread: a thread blocked in ``input()`` kept
    the process alive after Ctrl-C until Enter or a second Ctrl-C."""

    buffer = bytearray()
    closed = False

    @classmethod
    async def line(cls) -> str | None:
        while b"\n" not in cls.buffer and not cls.closed:
            cls._fill(await cls._readable())
        if not cls.buffer:
            return None
        line, _, rest = bytes(cls.buffer).partition(b"\n")
        cls.buffer[:] = rest
        return line.decode(errors="replace")

    @classmethod
    def _fill(cls, chunk: bytes) -> None:
        cls.buffer.extend(chunk)
        cls.closed = not chunk

    @staticmethod
    async def _readable() -> bytes:
        fd = sys.stdin.fileno()
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        try:
            loop.add_reader(fd, wake)
        except (PermissionError, ValueError):  # a regular file: reading never blocks
            return os.read(fd, 65_536)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        return os.read(fd, 65_536)


async def ask(request: dict[str, Any], state: CommandState) -> dict[str, Any]:
    """One input request (elicitation) answered at the terminal: yes or no."""
    params = request.get("params", request)
    # The prompt goes to stderr, so stdout stays the result alone (a pipe, --json).
    print(f"{params.get('message', 'input?')} [y/N] ", end="", file=sys.stderr, flush=True)
    state.at_prompt, status = True, state.status
    state.status = "input_required"
    try:
        answer = await _Stdin.line() if sys.stdin is not None else None
    finally:
        state.at_prompt, state.status = False, status
    if answer is None:  # no terminal to ask: decline rather than guess
        print(file=sys.stderr)
        return {"action": "decline"}
    return {"action": "accept", "content": {"ok": answer.strip().lower() in ("y", "yes")}}


def print_result(result: dict[str, Any]) -> int:
    out = {k: v for k, v in result.items() if k not in ("resultType", "_meta")}
    print(json.dumps(out, indent=2))
    return FAILED if out.get("isError") else OK


def task_outcome(task: dict[str, Any]) -> int:
    """Print a finished 2026-07-28 task's result (stdout) or how it ended (stderr)."""
    if task["status"] == "completed":
        return print_result(task.get("result") or {})
    if task["status"] == "failed":
        error = task.get("error") or {}
        print(f"mcp-tasks: task failed: {error.get('code')}: {error.get('message')}", file=sys.stderr)
    else:
        print(f"mcp-tasks: task {task['status']}", file=sys.stderr)
    return FAILED


async def follow_v2026(client: V2026Client, state: CommandState, poll_ms: int, retry_for: float) -> dict[str, Any]:
    """A 2026-07-28 task's final state, through subscriptions/listen (or by polling tasks/get when
    the server will not), answering its questions on the way."""
    assert state.task_id is not None
    task_id = state.task_id
    answered: set[str] = set()
    last: tuple[str, str] | None = None

    async def on_state(task: dict[str, Any]) -> bool:
        nonlocal last
        state.status = task["status"]
        shown = (task["status"], task.get("statusMessage") or "")
        if shown != last:
            print(f"  status {shown[0]}{' ' + shown[1] if shown[1] else ''}", file=sys.stderr)
            last = shown
        pending = {k: v for k, v in (task.get("inputRequests") or {}).items() if k not in answered}
        if pending:
            answers = {key: await ask(req, state) for key, req in pending.items()}
            answered.update(answers)
            await client.request("tasks/update", {"taskId": task_id, "inputResponses": answers})
        return task["status"] in TERMINAL

    try:
        async for message in client.listen([task_id]):
            if message.get("method") == "notifications/tasks" and await on_state(message["params"]):
                return dict(message["params"])
    except (McpClientError, httpx.HTTPError):
        pass  # no subscriptions here, or the stream broke (a restart): poll, which retries
    while True:
        task = dict(await client.request("tasks/get", {"taskId": task_id}, retry_for_s=retry_for))
        if await on_state(task):
            return task
        await asyncio.sleep(poll_ms / 1000)


def show_progress(message: dict[str, Any]) -> None:
    """A progress notification, one line on stderr (other notifications are not shown)."""
    if message.get("method") == "notifications/progress":
        p = message["params"]
        total = f"/{p['total']:g}" if "total" in p else ""
        print(f"  progress {p['progress']:g}{total} {p.get('message', '')}", file=sys.stderr)


async def _call_v2026(args: argparse.Namespace, arguments: dict[str, Any], state: CommandState) -> int:
    async with V2026Client(args.url, token=args.token) as client:
        # A progress token, so that the tool reports progress: the part inside the request streams
        # it (XD-18); once the call is a task, the task's status message carries it (X-NOTIF-8).
        params: dict[str, Any] = {"name": args.tool, "arguments": arguments, "_meta": {"progressToken": "cli"}}
        result = await client.request("tools/call", params, on_message=show_progress)
        while result.get("resultType") == "input_required":
            answers = {key: await ask(req, state) for key, req in (result.get("inputRequests") or {}).items()}
            result = await client.request("tools/call", {**params, "inputResponses": answers}, on_message=show_progress)
        if result.get("resultType") != "task":
            return print_result(result)
        state.task_id, state.status = result["taskId"], result["status"]
        remember(args.url, state.task_id)
        print(f"task {state.task_id} {state.status}", file=sys.stderr)
        task = await follow_v2026(client, state, int(result.get("pollIntervalMs", 1000)), 60.0)
    return task_outcome(task)


async def _call_v2025(args: argparse.Namespace, arguments: dict[str, Any], state: CommandState) -> int:
    async with McpClient(args.url, token=args.token) as client:
        await client.initialize()
        task = {"ttl": args.ttl}
        params = {"name": args.tool, "arguments": arguments, "task": task, "_meta": {"progressToken": "cli"}}
        created = await client.request("tools/call", params)
        state.task_id, state.status = created["task"]["taskId"], created["task"]["status"]
        print(f"task {state.task_id} {state.status}", file=sys.stderr)
        final: dict[str, Any] = {}
        async for message in client.stream("tasks/result", {"taskId": state.task_id}):
            method = message.get("method")
            if method == "notifications/progress":
                show_progress(message)
            elif method == "notifications/tasks/status":
                state.status = message["params"]["status"]
                print(f"  status {state.status}", file=sys.stderr)
            elif method == "elicitation/create":
                await client.respond(message["id"], await ask(message, state))
            elif "id" in message and "method" not in message:
                final = message
    if "error" in final:
        error = final["error"]
        print(
            f"mcp-tasks: task {state.status or 'failed'}: {error.get('code')}: {error.get('message')}", file=sys.stderr
        )
        return FAILED
    return print_result(final.get("result") or {})


async def call_main(args: argparse.Namespace, state: CommandState) -> int:
    check_url(args.url)
    arguments = dict(parse_arg(a) for a in args.arg)
    arguments.update(parse_arg(a, as_json=True) for a in args.json_arg)
    try:
        if args.wire == "2026-07-28":
            return await _call_v2026(args, arguments, state)
        return await _call_v2025(args, arguments, state)
    except (KeyError, TypeError) as exc:  # an answer of the wrong shape
        raise McpClientError(
            {"code": "protocol", "message": f"unexpected answer ({type(exc).__name__}: {exc})"}
        ) from None
