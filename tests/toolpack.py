"""A tool pack used only by tests: tools with each taskSupport value and outputs to check."""

from __future__ import annotations

import asyncio

from service.tools.api import ToolContext, ToolResult, text
from service.tools.registry import ToolPack

pack = ToolPack("tests")


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
async def hang(ctx: ToolContext) -> str:
    """Waits until cancelled; not safe to re-run."""
    await asyncio.Event().wait()
    return "never"
