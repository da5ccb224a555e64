"""How the client commands (``call``, ``tasks``, ``tools``) end: one exit code per outcome, one line
on stderr that says what to do next, never a traceback.

Exit codes (README, "Commands"):

    0    done
    1    the server refused, or the task ended badly (failed, cancelled, a tool error)
    2    usage: bad arguments, or a --url that is not an MCP endpoint
    3    no such task (unknown, expired, or another principal's)
    4    not authorized (401/403)
    5    the server cannot be reached, stays unavailable, or went away mid-call
    130  interrupted (Ctrl-C); the line says what became of the task and how to resume or cancel it
    141  the reader of stdout went away (``| head``); nothing more is printed

Failures arrive as ``McpClientError`` (the server's answer or a lost connection, from
``service.client``), ``httpx.HTTPError`` (the transport), ``KeyboardInterrupt`` and
``BrokenPipeError``; ``finish`` maps each to its code and line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import sys
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from service.client import McpClientError

OK, FAILED, USAGE, NOT_FOUND, UNAUTHORIZED, UNREACHABLE = 0, 1, 2, 3, 4, 5
INTERRUPTED, BROKEN_PIPE = 130, 141
# "Unavailable, retry shortly": HTTP 503, -32001 (2025-11-25), -31001 (2026-07-28, X-ERR-2).
UNAVAILABLE_CODES = (503, -32001, -31001)


class CommandError(Exception):
    """A condition the command itself found: its exit code and one line."""

    def __init__(self, code: int, line: str) -> None:
        super().__init__(line)
        self.code = code
        self.line = line


@dataclass
class CommandState:
    """What a client command has done so far, for the line printed when it is cut short."""

    url: str
    token: str | None = None
    wire: str = "2026-07-28"
    task_id: str | None = None
    status: str | None = None
    at_prompt: bool = False
    extra: list[str] = field(default_factory=list)

    def command(self, *words: str) -> str:
        """A command line the user can paste to reach this task again."""
        argv = ["mcp-tasks", "tasks", *words, "--url", self.url]
        if self.wire != "2026-07-28":
            argv += ["--wire", self.wire]
        if self.token:
            argv += ["--token", "$TOKEN"]
        return " ".join(a if a == "$TOKEN" else shlex.quote(a) for a in argv)

    def interrupted(self) -> str:
        if self.task_id is None:
            return "mcp-tasks: interrupted; no task was created (a call in flight may still have run: `mcp-tasks tasks list`)"
        where = "waiting for your answer" if self.status == "input_required" else f"still {self.status or 'working'}"
        return (
            f"mcp-tasks: interrupted; task {self.task_id} is {where} on the server: resume with "
            f"`{self.command('get', self.task_id, '--result')}`, cancel with `{self.command('cancel', self.task_id)}`"
        )


def check_url(url: str) -> None:
    """A --url must name the endpoint itself: a bare host answers nothing an MCP client can use."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CommandError(USAGE, f"mcp-tasks: --url {url!r} is not an http(s) URL; e.g. http://127.0.0.1:8000/mcp")
    if parts.path in ("", "/"):
        raise CommandError(
            USAGE, f"mcp-tasks: --url {url} has no path: give the MCP endpoint, e.g. {url.rstrip('/')}/mcp"
        )


def describe(exc: McpClientError, state: CommandState) -> tuple[int, str]:
    """The exit code and line of a refusal or a lost connection."""
    error = exc.error
    code, message = error.get("code"), " ".join(str(error.get("message", "")).split())[:300]
    status = error.get("http_status", code if isinstance(code, int) and code >= 400 else None)
    ongoing = f" (task {state.task_id} goes on: `{state.command('get', state.task_id)}`)" if state.task_id else ""
    if code == "connection":
        return UNREACHABLE, f"mcp-tasks: cannot reach {state.url} ({message}); is the server running?{ongoing}"
    if code == "protocol":
        return FAILED, f"mcp-tasks: {state.url} answered something that is not MCP ({message}); check --url{ongoing}"
    if status in (401, 403):
        hint = "pass a valid --token" if state.token is None or status == 401 else "the token lacks a scope"
        return UNAUTHORIZED, f"mcp-tasks: not authorized ({status}: {message}); {hint}"
    if code in (404, 405):  # no JSON-RPC answer at all: the path serves something else
        return USAGE, f"mcp-tasks: {state.url} is not an MCP endpoint (HTTP {status}); check --url (usually …/mcp)"
    if code in UNAVAILABLE_CODES or status == 503:
        return UNREACHABLE, f"mcp-tasks: {state.url} is unavailable ({message}); try again shortly{ongoing}"
    data = error.get("data")
    if code == -32602 and state.task_id and not (isinstance(data, dict) and "status" in data):
        return NOT_FOUND, f"mcp-tasks: task {state.task_id}: {message} (unknown, expired, or not yours)"
    return FAILED, f"mcp-tasks: the server refused: {code}: {message}"


def finish(main: Coroutine[Any, Any, int], state: CommandState) -> int:
    """Run a client command to its exit code: every way it can end is one line on stderr."""
    try:
        return asyncio.run(main)
    except KeyboardInterrupt:
        code, line = INTERRUPTED, ("\n" if state.at_prompt else "") + state.interrupted()
    except CommandError as exc:
        code, line = exc.code, exc.line
    except McpClientError as exc:
        code, line = describe(exc, state)
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit: point stdout at nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except httpx.HTTPError as exc:  # the transport broke outside a retried request: the server went away
        lost = McpClientError({"code": "connection", "message": f"{type(exc).__name__}: {exc}".rstrip(": ")})
        code, line = describe(lost, state)
    with contextlib.suppress(BrokenPipeError):
        print(line, file=sys.stderr)
    return code
