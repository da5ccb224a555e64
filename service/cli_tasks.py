"""``mcp-tasks tasks list|get|cancel``: look at and cancel tasks on a running server, as a client.

Exit codes (README, "CLI"): 0 done; 1 the server refused or the task ended badly (failed,
cancelled, a tool error); 2 usage; 3 no such task (unknown, expired, or another principal's);
4 not authorized (401/403: pass ``--token``); 5 the server cannot be reached or stays unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from typing import Any

import httpx

from service.client import McpClient, McpClientError, ModernClient

NOT_FOUND, UNAUTHORIZED, UNREACHABLE = 3, 4, 5
TERMINAL = ("completed", "failed", "cancelled")


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
    tasks = sub.add_parser("tasks", help="list, show or cancel tasks on a running server (as a client)")
    commands = tasks.add_subparsers(dest="tasks_command", required=True)

    def common(p: argparse.ArgumentParser, *, wire: bool) -> None:
        p.add_argument("--url", default="http://127.0.0.1:8000/mcp")
        p.add_argument("--token", default=None)
        p.add_argument("--json", action="store_true", help="print the server's JSON instead of text")
        p.add_argument("--retry-for", type=float, default=15.0, metavar="S",
                       help="keep retrying an unavailable or unreachable server for S seconds (default 15)")  # fmt: skip
        if wire:
            p.add_argument(
                "--wire", choices=["2025-11-25", "2026-07-28"], default="2025-11-25",
                help="protocol revision; a task made by `mcp-tasks call` (2026-07-28 by default) is read with 2026-07-28",
            )  # fmt: skip

    listing = commands.add_parser("list", help="your 2025-11-25 tasks, newest first (the 2026-07-28 wire has no list)")
    common(listing, wire=False)
    listing.add_argument("--cursor", default=None, help="the page after this cursor (printed by the previous page)")
    listing.add_argument("--all", action="store_true", help="every page, not just the first")
    get = commands.add_parser("get", help="one task's state (--result: wait for its result and print it)")
    common(get, wire=True)
    get.add_argument("task_id")
    get.add_argument("--result", action="store_true", help="wait until the task ends and print its result")
    cancel = commands.add_parser("cancel", help="cancel a working task")
    common(cancel, wire=True)
    cancel.add_argument("task_id")


def _fail(exc: McpClientError, args: argparse.Namespace) -> int:
    """One line on stderr for an expected condition, and its exit code; never a traceback."""
    error = exc.error
    code, message = error.get("code"), str(error.get("message", "")).strip()
    status = error.get("http_status", code if isinstance(code, int) and code >= 400 else None)
    if code == "connection":
        print(f"mcp-tasks: cannot reach {args.url} ({message}); is the server running?", file=sys.stderr)
        return UNREACHABLE
    if status in (401, 403):
        hint = "" if args.token else "; pass --token"
        print(f"mcp-tasks: not authorized ({status}){hint}: {message}", file=sys.stderr)
        return UNAUTHORIZED
    if code in (503, -32001):
        print(f"mcp-tasks: {args.url} is unavailable (still after {args.retry_for:g} s): {message}", file=sys.stderr)
        return UNREACHABLE
    data = error.get("data")
    data = data if isinstance(data, dict) else {}
    if code == -32602 and getattr(args, "task_id", None) and "status" not in data:
        hint = ""
        if getattr(args, "wire", None) == "2025-11-25":
            hint = " (a task made over 2026-07-28, e.g. by `mcp-tasks call`, is read with --wire 2026-07-28)"
        print(f"mcp-tasks: task {args.task_id}: {message}{hint}", file=sys.stderr)
        return NOT_FOUND
    print(f"mcp-tasks: error {code}: {message}", file=sys.stderr)
    return 1


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
    return 1 if out.get("isError") else 0


def _texts(result: dict[str, Any]) -> list[str]:
    content = result.get("content")
    if not isinstance(content, list) or not content:
        return []
    texts = [c.get("text") for c in content if isinstance(c, dict) and c.get("type") == "text"]
    return [t for t in texts if isinstance(t, str)] if len(texts) == len(content) else []


async def _list(client: McpClient, args: argparse.Namespace) -> int:
    tasks: list[dict[str, Any]] = []
    cursor = args.cursor
    while True:
        params = {"cursor": cursor} if cursor else {}
        page = await client.request("tasks/list", params, retry_for_s=args.retry_for)
        tasks.extend(page.get("tasks", []))
        cursor = page.get("nextCursor")
        if not cursor or not args.all:
            break
    if args.json:
        print(json.dumps({"tasks": tasks, **({"nextCursor": cursor} if cursor else {})}, indent=2))
        return 0
    for t in tasks:
        message = f"  {t['statusMessage']}" if t.get("statusMessage") else ""
        print(f"{t['taskId']}  {t['status']:<14}  {t.get('createdAt', '')}{message}")
    if cursor:
        print(f"more: --cursor={cursor} (or --all)", file=sys.stderr)
    return 0


async def _get_or_cancel(client: McpClient | ModernClient, args: argparse.Namespace) -> dict[str, Any] | None:
    """`tasks cancel`, or `tasks get` without --result: done and printed (None). `tasks get
    --result`: the task as it stands, for the caller to wait on (each wire waits its own way)."""
    params = {"taskId": args.task_id}
    if args.tasks_command == "cancel":
        _print_task(await client.request("tasks/cancel", params, retry_for_s=args.retry_for), args.json)
        return None
    task: dict[str, Any] = await client.request("tasks/get", params, retry_for_s=args.retry_for)
    if not args.result:
        _print_task(task, args.json)
        return None
    return task


async def _legacy(args: argparse.Namespace) -> int:
    async with McpClient(args.url, token=args.token) as client:
        try:
            await client.initialize(retry_for_s=args.retry_for)
            if args.tasks_command == "list":
                return await _list(client, args)
            task = await _get_or_cancel(client, args)
            if task is None:
                return 0
            return await _legacy_result(client, args)
        except McpClientError as exc:
            return _fail(exc, args)


async def _legacy_result(client: McpClient, args: argparse.Namespace) -> int:
    """tasks/result blocks until the task ends; a question the task asks meanwhile arrives on its
    stream and is answered at the terminal, as ``mcp-tasks call`` does. A broken stream (a restart)
    or "unavailable" is retried for ``--retry-for`` seconds from when it happened."""
    from service.cli import _ask

    loop = asyncio.get_running_loop()
    give_up: float | None = None
    delay = 0.25
    while True:
        try:
            final: dict[str, Any] = {}
            async for message in client.stream("tasks/result", {"taskId": args.task_id}):
                if message.get("method") == "elicitation/create":
                    await client.respond(message["id"], await _ask(message))
                elif "id" in message and "method" not in message:
                    final = message
            if "error" in final:
                raise McpClientError(final["error"])
            return _print_result(final.get("result", {}), args.json)
        except (httpx.TransportError, McpClientError) as exc:
            lost = isinstance(exc, httpx.TransportError)
            if isinstance(exc, McpClientError) and exc.error.get("code") not in (503, -32001):
                raise
            give_up = give_up if give_up is not None else loop.time() + args.retry_for
            if loop.time() + delay > give_up:
                if lost:
                    raise McpClientError({"code": "connection", "message": f"{type(exc).__name__}: {exc}"}) from None
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def _modern(args: argparse.Namespace) -> int:
    async with ModernClient(args.url, token=args.token) as client:
        try:
            params = {"taskId": args.task_id}
            task = await _get_or_cancel(client, args)
            if task is None:
                return 0
            while task["status"] not in TERMINAL:
                await asyncio.sleep(int(task.get("pollIntervalMs", 1000)) / 1000)
                task = await client.request("tasks/get", params, retry_for_s=args.retry_for)
        except McpClientError as exc:
            return _fail(exc, args)
    if task["status"] == "completed":
        return _print_result(task.get("result", {}), args.json)
    if task["status"] == "failed":
        error = task.get("error", {})
        print(f"mcp-tasks: task failed: {error.get('code')}: {error.get('message')}", file=sys.stderr)
    else:
        print(f"mcp-tasks: task {task['status']}", file=sys.stderr)
    return 1


async def tasks_main(args: argparse.Namespace) -> int:
    if getattr(args, "wire", "2025-11-25") == "2026-07-28":
        return await _modern(args)
    return await _legacy(args)
