"""``mcp-tasks tasks list|get|cancel``: look at and cancel tasks on a running server, as a client.

``get`` and ``cancel`` speak 2026-07-28 by default, like ``call``: it reads the caller's tasks of
both wires (XD-3). ``list`` asks both: 2025-11-25's ``tasks/list``, and ``tasks/get`` for the tasks
``call`` made over 2026-07-28 (which has no list; ``service.cli_history``). Exit codes:
``service.cli_exit``."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from typing import Any

import httpx

from service.cli_call import TERMINAL, ask, follow_v2026, task_outcome
from service.cli_exit import FAILED, OK, CommandError, CommandState, check_url
from service.cli_history import remembered
from service.client import McpClient, McpClientError, V2026Client

# A task id is 43 characters of URL-safe base64 (secrets.token_urlsafe(32)), so one in 64 begins
# with "-", which argparse would read as options.
_DASHED_TASK_ID = re.compile(r"-[A-Za-z0-9_-]{42}")


def protect_task_ids(argv: list[str]) -> list[str]:
    """``tasks get|cancel`` with a task id that begins with "-": the id goes after a ``--``, so it
    is read as the task id wherever it was written (the user may also write ``--`` themselves).
    ``tasks list --cursor C`` with a cursor that begins with "-" (URL-safe base64 too: one in 32)
    becomes ``--cursor=C``, which argparse reads as the option's value."""
    if argv[:2] == ["tasks", "list"]:
        out = list(argv)
        for i in range(2, len(out) - 1):
            if out[i] == "--cursor" and out[i + 1].startswith("-"):
                out[i : i + 2] = [f"--cursor={out[i + 1]}"]
                break
        return out
    if argv[:1] != ["tasks"] or argv[1:2] not in (["get"], ["cancel"]) or "--" in argv:
        return argv
    ids = [arg for arg in argv[2:] if _DASHED_TASK_ID.fullmatch(arg)]
    if not ids:
        return argv
    return [arg for arg in argv if arg not in ids] + ["--", *ids]


def add_parser(sub: Any) -> None:
    tasks = sub.add_parser("tasks", help="list, show or cancel your tasks on a running server (as a client)")
    commands = tasks.add_subparsers(dest="tasks_command", required=True)

    def common(p: argparse.ArgumentParser, *, wire: bool) -> None:
        p.add_argument("--url", default="http://127.0.0.1:8000/mcp")
        p.add_argument("--token", default=None)
        p.add_argument("--json", action="store_true", help="print the server's JSON instead of text")
        p.add_argument("--retry-for", type=float, default=15.0, metavar="S",
                       help="keep retrying an unavailable or unreachable server for S seconds (default 15)")  # fmt: skip
        if wire:
            p.add_argument(
                "--wire", choices=["2026-07-28", "2025-11-25"], default="2026-07-28",
                help="protocol revision (default 2026-07-28, as `mcp-tasks call`; it reads tasks of both wires)",
            )  # fmt: skip

    listing = commands.add_parser(
        "list", help="your tasks, newest first: the 2025-11-25 list, and those `mcp-tasks call` made over 2026-07-28"
    )
    common(listing, wire=False)
    listing.add_argument("--cursor", default=None, help="the page after this cursor (printed by the previous page)")
    listing.add_argument("--all", action="store_true", help="every page, not just the first")
    get = commands.add_parser("get", help="one task's state (--result: wait for its result and print it)")
    common(get, wire=True)
    get.add_argument("task_id")
    get.add_argument("--result", action="store_true", help="wait until the task ends (answering its questions)")
    cancel = commands.add_parser("cancel", help="cancel a working task")
    common(cancel, wire=True)
    cancel.add_argument("task_id")


def _print_task(task: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(task, indent=2))
        return
    for key in ("taskId", "status", "statusMessage", "createdAt", "lastUpdatedAt", "ttl", "ttlMs", "pollInterval",
                "pollIntervalMs"):  # fmt: skip
        if task.get(key) is not None:
            print(f"{key}: {task[key]}")


def _print_result(result: dict[str, Any], as_json: bool) -> int:
    out = {k: v for k, v in result.items() if k not in ("resultType", "_meta")}
    print(json.dumps(out, indent=2) if as_json or not _texts(out) else "\n".join(_texts(out)))
    return FAILED if out.get("isError") else OK


def _texts(result: dict[str, Any]) -> list[str]:
    content = result.get("content")
    if not isinstance(content, list) or not content:
        return []
    texts = [c.get("text") for c in content if isinstance(c, dict) and c.get("type") == "text"]
    return [t for t in texts if isinstance(t, str)] if len(texts) == len(content) else []


async def _v2026_tasks(args: argparse.Namespace, known: set[str]) -> list[dict[str, Any]]:
    """The tasks ``call`` made here over 2026-07-28 that the server still shows this caller."""
    found = []
    async with V2026Client(args.url, token=args.token) as client:
        for entry in remembered(args.url):
            if entry.task_id in known:
                continue
            known.add(entry.task_id)
            try:
                task = await client.request("tasks/get", {"taskId": entry.task_id}, retry_for_s=args.retry_for)
            except McpClientError as exc:
                if exc.error.get("code") == -32602:  # expired, or another principal's
                    continue
                raise
            found.append({k: v for k, v in task.items() if k not in ("resultType", "result", "error", "inputRequests")})
    return found


async def _list(args: argparse.Namespace) -> int:
    tasks: list[dict[str, Any]] = []
    cursor = args.cursor
    async with McpClient(args.url, token=args.token) as client:
        await client.initialize(retry_for_s=args.retry_for)
        while True:
            params = {"cursor": cursor} if cursor else {}
            page = await client.request("tasks/list", params, retry_for_s=args.retry_for)
            tasks.extend(page.get("tasks", []))
            cursor = page.get("nextCursor")
            if not cursor or not args.all:
                break
    if not args.cursor:  # the first page also shows the 2026-07-28 tasks, newest first among the rest
        tasks += await _v2026_tasks(args, {t["taskId"] for t in tasks})
        tasks.sort(key=lambda t: str(t.get("createdAt", "")), reverse=True)
    if args.json:
        print(json.dumps({"tasks": tasks, **({"nextCursor": cursor} if cursor else {})}, indent=2))
        return OK
    for t in tasks:
        message = f"  {t['statusMessage']}" if t.get("statusMessage") else ""
        print(f"{t['taskId']}  {t['status']:<14}  {t.get('createdAt', '')}{message}")
    if cursor:
        print(f"more: --cursor={cursor} (or --all)", file=sys.stderr)
    return OK


async def _get_or_cancel(client: McpClient | V2026Client, args: argparse.Namespace) -> dict[str, Any] | None:
    """`tasks cancel`, or `tasks get` without --result: done and printed (None). `tasks get
    --result`: the task as it stands, for the caller to wait on (each wire waits its own way)."""
    params = {"taskId": args.task_id}
    if args.tasks_command == "cancel":
        if isinstance(client, V2026Client):  # 2026-07-28 acks even a task that had ended (XD-7): look first
            before = await client.request("tasks/get", params, retry_for_s=args.retry_for)
            if before["status"] in TERMINAL:
                raise CommandError(FAILED, f"mcp-tasks: task {args.task_id} is {before['status']}: nothing to cancel")
        shown = await client.request("tasks/cancel", params, retry_for_s=args.retry_for)
        if isinstance(client, V2026Client):
            shown = await client.request("tasks/get", params, retry_for_s=args.retry_for)
            shown = {k: v for k, v in shown.items() if k not in ("resultType", "result", "error", "inputRequests")}
        _print_task(shown, args.json)
        return None
    task: dict[str, Any] = await client.request("tasks/get", params, retry_for_s=args.retry_for)
    if not args.result:
        _print_task(task, args.json)
        return None
    return task


async def _v2025(args: argparse.Namespace, state: CommandState) -> int:
    async with McpClient(args.url, token=args.token) as client:
        await client.initialize(retry_for_s=args.retry_for)
        task = await _get_or_cancel(client, args)
        if task is None:
            return OK
        state.status = task.get("status")
        return await _v2025_result(client, args, state)


async def _v2025_result(client: McpClient, args: argparse.Namespace, state: CommandState) -> int:
    """tasks/result blocks until the task ends; a question the task asks meanwhile arrives on its
    stream and is answered at the terminal, as ``mcp-tasks call`` does. A broken stream (a restart)
    or "unavailable" is retried for ``--retry-for`` seconds from when it happened."""
    loop = asyncio.get_running_loop()
    give_up: float | None = None
    delay = 0.25
    while True:
        try:
            final: dict[str, Any] = {}
            async for message in client.stream("tasks/result", {"taskId": args.task_id}):
                if message.get("method") == "elicitation/create":
                    await client.respond(message["id"], await ask(message, state))
                elif "id" in message and "method" not in message:
                    final = message
            if "error" in final:
                raise McpClientError(final["error"])
            return _print_result(final.get("result", {}), args.json)
        except (httpx.TransportError, McpClientError) as exc:
            lost = isinstance(exc, httpx.TransportError)
            if isinstance(exc, McpClientError) and not exc.retryable:
                raise
            give_up = give_up if give_up is not None else loop.time() + args.retry_for
            if loop.time() + delay > give_up:
                if lost:
                    raise McpClientError({"code": "connection", "message": f"{type(exc).__name__}: {exc}"}) from None
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def _v2026(args: argparse.Namespace, state: CommandState) -> int:
    async with V2026Client(args.url, token=args.token) as client:
        task = await _get_or_cancel(client, args)
        if task is None:
            return OK
        state.status = task["status"]
        if task["status"] not in TERMINAL:
            task = await follow_v2026(client, state, int(task.get("pollIntervalMs", 1000)), args.retry_for)
    if task["status"] == "completed":
        return _print_result(task.get("result") or {}, args.json)
    return task_outcome(task)


async def tasks_main(args: argparse.Namespace, state: CommandState) -> int:
    check_url(args.url)
    if args.tasks_command == "list":
        return await _list(args)
    state.task_id = args.task_id
    if args.wire == "2026-07-28":
        return await _v2026(args, state)
    return await _v2025(args, state)
