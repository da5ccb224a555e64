"""Demo tool pack (on by default): echo, sleep, fail, crash, confirm, count."""

from __future__ import annotations

import asyncio

from service.tools.api import ToolContext, ToolError, ToolFailure
from service.tools.registry import ToolPack

pack = ToolPack("demo")


@pack.tool(rerunnable=True)
async def echo(ctx: ToolContext, text: str) -> str:
    """Return the text at once."""
    return text


@pack.tool(rerunnable=True)
async def sleep(ctx: ToolContext, seconds: float) -> str:
    """Wait the given number of seconds (cancellable), reporting progress about once a second (when
    the client asked for progress)."""
    if not 0 <= seconds <= 86_400:  # also refuses NaN
        raise ToolError("seconds must be a number between 0 and 86400")
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    step = 0
    while (left := end - loop.time()) > 0:
        if not ctx.reports_progress:  # no one to tell (or no longer): one wait, not a wake-up a second
            await asyncio.sleep(left)
            break
        await asyncio.sleep(min(1.0, left))
        step += 1
        await ctx.progress(min(step, seconds), seconds, f"slept {min(step, seconds):g} of {seconds:g}s")
    return f"slept {seconds:g}s"


@pack.tool(rerunnable=True)
async def fail(ctx: ToolContext, message: str) -> str:
    """End with a tool error (isError: true) carrying the message."""
    raise ToolError(message)


@pack.tool()
async def crash(ctx: ToolContext, message: str) -> str:
    """End the call as failed (a protocol error, not a result) carrying the message."""
    raise ToolFailure(message)


@pack.tool()
async def confirm(ctx: ToolContext, prompt: str = "Proceed?") -> str:
    """Ask the client to confirm (elicitation; input_required in a task) and return the answer."""
    answer = await ctx.elicit(
        prompt,
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean", "title": "Confirm", "description": prompt}},
            "required": ["ok"],
        },
    )
    if answer.action != "accept":
        return f"action={answer.action}"
    content = answer.content or {}
    return "answer: " + ", ".join(f"{k}={v}" for k, v in sorted(content.items()))


@pack.tool(rerunnable=True)
async def count(ctx: ToolContext, n: int, interval_ms: int = 100) -> str:
    """Count from 1 to n, one progress notification per step."""
    if n < 0 or n > 100_000 or interval_ms < 0 or interval_ms > 60_000:
        raise ToolError("n must be in 0..100000 and interval_ms in 0..60000")
    for i in range(1, n + 1):
        await asyncio.sleep(interval_ms / 1000)
        await ctx.progress(i, n, f"counted {i} of {n}")
    return f"counted to {n}"
