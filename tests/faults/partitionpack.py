"""Tools for the partition tests: each records its executions in the file named by
``FAULTS_PARTITION_LOG``, one line ``<start|end|cancelled> <task id> <pid>`` per event (O_APPEND:
one short write is atomic, and both replicas share the file), so a test counts how often a task
ran, how each run ended and on which process."""

from __future__ import annotations

import asyncio
import os

from service.tools.api import ToolContext
from service.tools.registry import ToolPack

pack = ToolPack("partition")


def _record(event: str, ctx: ToolContext) -> None:
    path = os.environ.get("FAULTS_PARTITION_LOG")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{event} {ctx.task_id or '-'} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


async def _work(ctx: ToolContext, seconds: float) -> str:
    _record("start", ctx)
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        _record("cancelled", ctx)
        raise
    _record("end", ctx)
    return f"worked {seconds:g}s"


@pack.tool(task_support="required", rerunnable=True)
async def partition_work(ctx: ToolContext, seconds: float = 1.0) -> str:
    """Works ``seconds``; safe to run again when its runner is lost."""
    return await _work(ctx, seconds)


@pack.tool(task_support="required")
async def partition_work_once(ctx: ToolContext, seconds: float = 1.0) -> str:
    """Works ``seconds``; must never run twice."""
    return await _work(ctx, seconds)


def executions(path: str) -> dict[str, list[tuple[str, int]]]:
    """task id -> its events in order, as (event, pid)."""
    runs: dict[str, list[tuple[str, int]]] = {}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return runs
    for line in lines:
        event, task_id, pid = line.split()
        runs.setdefault(task_id, []).append((event, int(pid)))
    return runs
