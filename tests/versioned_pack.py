"""Tool packs used only by tests: the same tool at two versions, as two releases of a pack would have it."""

from __future__ import annotations

from service.tools.api import ToolContext
from service.tools.registry import ToolPack

v1 = ToolPack("versioned-1")
v2 = ToolPack("versioned-2")


@v1.tool(name="stamp", version="1", rerunnable=True)
async def stamp_v1(ctx: ToolContext, text: str = "") -> str:
    return f"v1:{text}"


@v2.tool(name="stamp", version="2", rerunnable=True)
async def stamp_v2(ctx: ToolContext, text: str = "") -> str:
    return f"v2:{text}"
