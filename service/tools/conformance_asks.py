"""How the 2026-07-28 conformance fixtures ask the client: keyed questions, asked together, withdrawn together."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from service.tools.api import ElicitAnswer, ToolContext, text

T = TypeVar("T")


def form(**properties: str) -> dict[str, Any]:
    """A requestedSchema of required primitive fields: name -> JSON type."""
    return {
        "type": "object",
        "properties": {name: {"type": kind} for name, kind in properties.items()},
        "required": list(properties),
    }


async def elicit(ctx: ToolContext, key: str, message: str, schema: dict[str, Any]) -> ElicitAnswer:
    """Ask one form question under ``key`` (the retried call answers it by that key)."""
    return await ctx.elicit(message, schema, key=key)


async def sample(ctx: ToolContext, key: str, question: str, max_tokens: int) -> str:
    params = {"messages": [{"role": "user", "content": text(question)}], "maxTokens": max_tokens}
    content = (await ctx.sample(params, key=key)).get("content")
    return str(content.get("text", "")) if isinstance(content, dict) else ""


async def roots(ctx: ToolContext, key: str) -> list[dict[str, Any]]:
    """The client's roots."""
    return await ctx.list_roots(key=key)


async def together(*asks: Awaitable[T]) -> list[T]:
    """Ask at once (asyncio.gather); if one fails, withdraw the others before re-raising."""
    tasks = [asyncio.ensure_future(ask) for ask in asks]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def accepted(answer: ElicitAnswer) -> dict[str, Any]:
    return (answer.content or {}) if answer.action == "accept" else {}
