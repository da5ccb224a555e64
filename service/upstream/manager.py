"""The upstreams of this process: each followed, its exposed tools in the registry as
``<upstream>.<tool>``, like a pack's (the same caps, TTLs, audit rows and wires)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from typing import Any, Final, Protocol

import orjson
from mcp import types

from service.tools.api import ToolContext
from service.tools.registry import Registry, ToolSpec
from service.upstream.config import UpstreamConfig
from service.upstream.connection import CONNECT_TIMEOUT_S
from service.upstream.upstream import Upstream

SOURCE: Final = "upstream {}"
REPORT_S: Final = 10.0
log = logging.getLogger(__name__)


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


class StateBoard(Protocol):
    """Where this process says what it sees of its upstreams (the database, for ``mcp-tasks
    upstreams``): each state is one upstream's ``Upstream.status()``."""

    async def publish(self, states: list[dict[str, Any]], live_ms: int) -> None: ...

    async def withdraw(self) -> None: ...


class Upstreams:
    """``board``: told every ``REPORT_S`` and soon after a change; None: nowhere."""

    def __init__(
        self, configs: list[UpstreamConfig], registry: Registry, *, grace_s: float, max_result_bytes: int,
        board: StateBoard | None = None,
    ) -> None:  # fmt: skip
        self.registry = registry
        self.board = board
        self._changed = asyncio.Event()
        self.upstreams = {
            c.name: Upstream(c, on_tools=self._publish, grace_s=grace_s, max_result_bytes=max_result_bytes)
            for c in configs
        }
        for upstream in self.upstreams.values():
            upstream.on_change = self._changed.set
        self._reporter: asyncio.Task[None] | None = None

    async def start(self, wait_s: float = CONNECT_TIMEOUT_S + 1) -> None:
        """Follow every upstream; wait (at most ``wait_s``) for each one's first try, so that the
        tools of those up at start are listed from the first request on."""
        for upstream in self.upstreams.values():
            upstream.start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await asyncio.gather(*(u.tried.wait() for u in self.upstreams.values()))
        if self.board is not None:
            self._reporter = asyncio.create_task(self._report(self.board), name="upstreams-report")

    async def stop(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            with contextlib.suppress(BaseException):
                await self._reporter
        await asyncio.gather(*(u.stop() for u in self.upstreams.values()))
        if self.board is not None:
            with contextlib.suppress(Exception):  # its rows lapse by themselves
                await asyncio.wait_for(self.board.withdraw(), 5)

    async def _report(self, board: StateBoard) -> None:
        """Say what this process sees: now, on each change (a second later at most), and every
        REPORT_S; a failed write is tried again at the next."""
        while True:
            self._changed.clear()
            try:
                await board.publish(self.status(), int(REPORT_S * 3 * 1000))
            except Exception as exc:
                log.warning("could not record the upstreams' state: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), REPORT_S)
            await asyncio.sleep(1.0)  # changes in a burst make one write

    def _publish(self, upstream: Upstream) -> None:
        specs = [tool_spec(upstream, tool) for tool in upstream.tools.values()]
        self.registry.set_tools(SOURCE.format(upstream.config.name), specs)

    def status(self) -> list[dict[str, Any]]:
        return [u.status() for u in self.upstreams.values()]
