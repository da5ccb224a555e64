"""What a runner says it can run: its tools, by name and version, published in its row (and the
tools' limit metrics), again whenever an upstream's tools change, so that it claims only tasks of
tools it has, in the version they were accepted for."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from service.observability import metrics

if TYPE_CHECKING:
    from service.runtime.runs import Runs
    from service.store.runners import RunnerStore
    from service.tools.registry import Registry

log = logging.getLogger("service.runtime.runner")


class ToolPublishing:
    """Part of ``Runner``."""

    if TYPE_CHECKING:
        registry: Registry
        runs: Runs
        store: RunnerStore
        owner: str
        lease_ms: int
        poll_s: float
        _tools: dict[str, str | None]
        _wake: asyncio.Event

        def _spawn(self, job: Any) -> asyncio.Task[Any]: ...

    def _tool_metrics(self) -> None:
        for name, spec in self.registry.tools.items():
            limit_s = spec.runtime_limit_s(self.runs.limits.max_runtime_s)
            metrics.tool_runtime_limit_seconds.labels(name).set(limit_s)
            for limit in ("runtime", "input"):  # at zero, so that rates exist before the first failure
                metrics.labelled(metrics.task_limit_failures, name, limit)

    async def _publish(self) -> None:
        """Say what this runner can run, for a lease's time (the maintenance pass tells tasks whose
        tool no live runner has so, see runners.sql). The heartbeat keeps it live."""
        tools = {name: {"version": spec.version, "rerunnable": spec.rerunnable}
                 for name, spec in self.registry.tools.items()}  # fmt: skip
        await self.store.publish(self.owner, tools, self.lease_ms)

    def _tools_changed(self) -> None:
        """An upstream's tools came, went or changed: claim by the new set, and say so."""
        self._tools = {name: self.registry.tools[name].version for name in sorted(self.registry.tools)}
        self._tool_metrics()
        self._spawn(self._publish_tools())

    async def _publish_tools(self) -> None:
        for attempt in range(5):
            try:
                await self._publish()
                break
            except Exception as exc:  # a database blip: again, a poll interval later
                log.warning("runner could not publish its changed tools (attempt %d of 5): %s", attempt + 1, exc)
                await asyncio.sleep(self.poll_s)
        self._wake.set()  # queued tasks of a tool that just came may be claimable now
