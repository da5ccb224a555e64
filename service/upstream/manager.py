"""The upstreams of this process: each followed, its exposed tools in the registry as
``<upstream>.<tool>``, like a pack's (the same caps, TTLs, audit rows and wires)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any, Final

import orjson
from mcp import types

from service.tools.api import ToolContext
from service.tools.registry import Registry, ToolSpec
from service.upstream.config import UpstreamConfig
from service.upstream.connection import CONNECT_TIMEOUT_S
from service.upstream.upstream import Upstream

SOURCE: Final = "upstream {}"


def tool_version(tool: types.Tool) -> str:
    """The version a task of the tool is accepted for: its schemas' digest, so that a task accepted
    for one schema never runs against another (a runner claims only at the version it has)."""
    schemas = {"in": tool.inputSchema, "out": tool.outputSchema}
    return "schema-" + hashlib.sha256(orjson.dumps(schemas, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def tool_spec(upstream: Upstream, tool: types.Tool) -> ToolSpec:
    config = upstream.config
    name = tool.name

    async def run(ctx: ToolContext, /, **arguments: Any) -> dict[str, Any]:
        return await upstream.run(name, arguments, ctx)

    wire = tool.model_dump(by_alias=True, exclude_none=True, mode="json")
    return ToolSpec(
        name=config.prefix + name, fn=run, description=tool.description or "", input_schema=wire["inputSchema"],
        task_support=config.task_support, rerunnable=config.rerunnable, output_schema=wire.get("outputSchema"),
        title=tool.title, annotations=wire.get("annotations") or None, version=tool_version(tool),
        origin={"upstream": config.name, "upstream_tool": name}, replays=False,
    )  # fmt: skip


class Upstreams:
    def __init__(
        self, configs: list[UpstreamConfig], registry: Registry, *, grace_s: float, max_result_bytes: int
    ) -> None:
        self.registry = registry
        self.upstreams = {
            c.name: Upstream(c, on_tools=self._publish, grace_s=grace_s, max_result_bytes=max_result_bytes)
            for c in configs
        }

    async def start(self, wait_s: float = CONNECT_TIMEOUT_S + 1) -> None:
        """Follow every upstream; wait (at most ``wait_s``) for each one's first try, so that the
        tools of those up at start are listed from the first request on."""
        for upstream in self.upstreams.values():
            upstream.start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await asyncio.gather(*(u.tried.wait() for u in self.upstreams.values()))

    async def stop(self) -> None:
        await asyncio.gather(*(u.stop() for u in self.upstreams.values()))

    def _publish(self, upstream: Upstream) -> None:
        specs = [tool_spec(upstream, tool) for tool in upstream.tools.values()]
        self.registry.set_tools(SOURCE.format(upstream.config.name), specs)

    def status(self) -> list[dict[str, Any]]:
        return [u.status() for u in self.upstreams.values()]
