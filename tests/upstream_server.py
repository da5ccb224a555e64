"""An upstream MCP server for the tests, written with the official MCP Python SDK (FastMCP), with no
task support of its own: what an operator puts behind the service.

    python -m tests.upstream_server http PORT [--marks DIR]   # Streamable HTTP at /mcp
    python -m tests.upstream_server stdio [--marks DIR]

``--marks DIR``: each call adds a line to ``DIR/<tool>-<n>.started``, and a cancelled call to
``DIR/<tool>-<n>.cancelled`` (what the tests read to see what reached the upstream; n counts the
process's calls of that tool).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import weakref
from pathlib import Path

import anyio
from mcp.server.fastmcp import Context, FastMCP
from mcp.server.session import ServerSession
from mcp.types import Tool
from pydantic import BaseModel

args_parser = argparse.ArgumentParser()
args_parser.add_argument("transport", choices=["http", "stdio"])
args_parser.add_argument("port", nargs="?", type=int, default=0)
args_parser.add_argument("--marks", default=None)
ARGS = args_parser.parse_args()
MARKS = Path(ARGS.marks) if ARGS.marks else None
SEQ = itertools.count(1)


class Upstream(FastMCP):  # type: ignore[type-arg]
    """FastMCP that remembers the sessions that listed its tools, to tell each when the list changes
    (FastMCP tells only the session of the request that made the change)."""

    listers: weakref.WeakSet[ServerSession] = weakref.WeakSet()

    async def list_tools(self) -> list[Tool]:
        with contextlib.suppress(Exception):  # (no request context: nobody to remember)
            self.listers.add(self.get_context().session)
        return await super().list_tools()


server = Upstream(
    "test-upstream", host="127.0.0.1", port=ARGS.port or 8000, log_level="CRITICAL"
)  # its session-close noise is not ours to read


def mark(tool: str, n: int, what: str) -> None:
    """One line (this process's id) per event: a restarted server counts from 1 again."""
    if MARKS is not None:
        with (MARKS / f"{tool}-{n}.{what}").open("a") as f:
            f.write(f"{os.getpid()}\n")


@server.tool()
async def echo(text: str) -> str:
    """Return the text."""
    mark("echo", next(SEQ), "started")
    return text


@server.tool()
async def sleep(seconds: float, ctx: Context) -> str:  # type: ignore[type-arg]
    """Sleep, reporting progress every 0.2 s."""
    n = next(SEQ)
    mark("sleep", n, "started")
    steps = max(1, int(seconds / 0.2))
    try:
        for i in range(1, steps + 1):
            await anyio.sleep(seconds / steps)
            await ctx.report_progress(i, steps, f"step {i} of {steps}")
    except anyio.get_cancelled_exc_class():
        mark("sleep", n, "cancelled")
        raise
    return f"slept {seconds:g}s"


@server.tool()
async def hang(ctx: Context) -> str:  # type: ignore[type-arg]
    """Never answer, and send nothing."""
    n = next(SEQ)
    mark("hang", n, "started")
    try:
        await anyio.sleep_forever()
    except anyio.get_cancelled_exc_class():
        mark("hang", n, "cancelled")
        raise
    return "unreachable"


class Answer(BaseModel):
    ok: bool


@server.tool()
async def confirm(prompt: str, ctx: Context) -> str:  # type: ignore[type-arg]
    """Ask the client (form elicitation) and return the answer."""
    mark("confirm", next(SEQ), "started")
    answer = await ctx.elicit(prompt, Answer)
    if answer.action != "accept":
        return f"action={answer.action}"
    return f"ok={answer.data.ok}"


@server.tool()
async def fail(message: str) -> str:
    """End with a tool error (isError)."""
    raise ValueError(message)


@server.tool()
async def die() -> str:
    """Exit the process in the middle of the call."""
    mark("die", next(SEQ), "started")
    await anyio.sleep(0.2)
    os._exit(3)


@server.tool()
async def whoami(ctx: Context) -> dict[str, str | None]:  # type: ignore[type-arg]
    """The headers that say who calls (and with what credentials)."""
    request = ctx.request_context.request
    headers = request.headers if request is not None else {}
    return {name: headers.get(name) for name in ("authorization", "x-tenant", "x-subject")}


@server.tool()
async def getenv(name: str) -> str:
    """An environment variable of this process ("" when unset)."""
    return os.environ.get(name, "")


async def grown() -> str:
    """Added by grow."""
    return "grown"


@server.tool()
async def grow() -> str:
    """Add the tool ``grown`` and tell every session that listed the tools (list_changed)."""
    server.add_tool(grown, name="grown")
    for session in list(Upstream.listers):
        with contextlib.suppress(Exception):  # a session that has gone
            await session.send_tool_list_changed()
    return "grew"


@server.tool()
async def big(kib: int) -> str:
    """Answer with about ``kib`` KiB of text."""
    return "x" * (kib * 1024)


if __name__ == "__main__":
    if ARGS.transport == "http":
        server.run(transport="streamable-http")
    else:
        print("upstream on stdio", file=sys.stderr)
        server.run()
