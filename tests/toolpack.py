"""A tool pack used only by tests: tools with each taskSupport value and outputs to check."""

from __future__ import annotations

import asyncio

from service.tools.api import ToolContext, ToolResult, text
from service.tools.registry import ToolPack

pack = ToolPack("tests")

_signals: dict[str, asyncio.Event] = {}


def signal(key: str, what: str) -> asyncio.Event:
    """An event that the tools below set when given ``key`` ("started", "cancelled", "returned"),
    for tests whose server runs in their own process and event loop to wait on instead of sleeping."""
    return _signals.setdefault(f"{key}:{what}", asyncio.Event())


def _mark(key: str, what: str) -> None:
    if key:
        signal(key, what).set()


@pack.tool(task_support="forbidden")
async def quick(ctx: ToolContext, text: str = "quick") -> str:
    """A tool that must not run as a task."""
    return text


@pack.tool(task_support="required")
async def batch(ctx: ToolContext, items: int = 1) -> ToolResult:
    """A tool that only runs as a task."""
    await asyncio.sleep(0)
    return ToolResult([text(f"processed {items}")], structured={"processed": items})


@pack.tool(task_support="optional")
async def hang(ctx: ToolContext, key: str = "") -> str:
    """Waits until cancelled; not safe to re-run."""
    _mark(key, "started")
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        _mark(key, "cancelled")
        raise
    return "never"


@pack.tool(task_support="optional")
async def stubborn(ctx: ToolContext, seconds: float = 0.5, key: str = "", after: float | None = None) -> str:
    """Ignores cancellation and finishes anyway (for T-CANCEL-6): ``after`` seconds after the
    cancel (``seconds`` when not given)."""
    _mark(key, "started")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        _mark(key, "cancelled")
        await asyncio.sleep(seconds if after is None else after)
    _mark(key, "returned")
    return "finished anyway"


@pack.tool(task_support="optional")
async def nul_output(ctx: ToolContext) -> str:
    """Returns text with a NUL character, which PostgreSQL cannot store as is."""
    return "before\x00after"


@pack.tool(task_support="optional")
async def log_then_crash(ctx: ToolContext) -> str:
    """Says something (switching a plain call to SSE), then ends with a JSON-RPC error."""
    from service.tools.api import RpcError

    await ctx.log("info", "about to fail")
    raise RpcError(-32001, "failed after talking")


@pack.tool(task_support="optional")
async def leaky(ctx: ToolContext) -> str:
    """Raises an exception whose message holds a secret."""
    raise RuntimeError("dsn=postgresql://admin:hunter2@db/prod")


@pack.tool(task_support="optional")
async def ask_two(ctx: ToolContext) -> str:
    """Asks two questions at once (both pending together) and reports both answers."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    answers = await asyncio.gather(ctx.elicit("first?", schema), ctx.elicit("second?", schema))
    return " ".join(f"{a.action}:{(a.content or {}).get('n')}" for a in answers)


@pack.tool(task_support="optional")
async def slow_confirm(ctx: ToolContext, seconds: float = 0.5) -> str:
    """Works a while (long enough to become a task), then asks the client to confirm."""
    await asyncio.sleep(seconds)
    answer = await ctx.elicit("Go on?", {"type": "object", "properties": {"ok": {"type": "boolean"}}})
    return f"{answer.action}:{(answer.content or {}).get('ok')}"


@pack.tool(task_support="required", rerunnable=True)
async def slow_fail(ctx: ToolContext, seconds: float = 0.3) -> ToolResult:
    """Runs only as a task, then ends with a tool error (isError: true)."""
    await asyncio.sleep(seconds)
    return ToolResult([text("it broke")], is_error=True)


@pack.tool(task_support="optional")
async def progress_wanted(ctx: ToolContext, seconds: float = 0.0) -> str:
    """Says whether its progress would reach anyone (ToolContext.reports_progress); with
    ``seconds``, at its start and again after sleeping that long (a call may become a task meanwhile)."""
    if not seconds:
        return f"reports_progress={ctx.reports_progress}"
    before = ctx.reports_progress
    await asyncio.sleep(seconds)
    return f"reports_progress={before}->{ctx.reports_progress}"


@pack.tool(task_support="optional", max_runtime_s=1.0)
async def bounded(ctx: ToolContext, seconds: float = 60.0, key: str = "") -> str:
    """Sleeps ``seconds``; its pack gives it a runtime limit of 1 s (below the operator's ceiling)."""
    _mark(key, "started")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        _mark(key, "cancelled")
        raise
    return f"slept {seconds:g} s"


@pack.tool(task_support="optional")
async def confirm_then_sleep(ctx: ToolContext, seconds: float = 1.0, first: float = 0.2) -> str:
    """Works ``first`` seconds (long enough to become a task), asks the client to confirm, then
    works ``seconds`` more."""
    await asyncio.sleep(first)
    answer = await ctx.elicit("Go on?", {"type": "object", "properties": {"ok": {"type": "boolean"}}})
    await asyncio.sleep(seconds)
    return f"{answer.action} then slept {seconds:g} s"


@pack.tool()
async def log_line(ctx: ToolContext, text: str) -> str:
    """Write one log line from inside the run (what a pack's own logging does), and return."""
    import logging

    logging.getLogger("tests.toolpack").warning("the tool says %s", text)
    return text
