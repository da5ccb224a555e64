"""Tools for the fault tests (issue 13, point 7): each one records its executions, so a test can
count how often a task ran and on which process.

Every start and every end appends one line ``<start|end> <task id> <pid> <tool>`` to the file named by
``FAULTS_RUNS_LOG`` (O_APPEND: one short write is atomic, and two replicas may share it).
"""

from __future__ import annotations

import asyncio
import os

from service.tools.api import ToolContext
from service.tools.registry import ToolPack

pack = ToolPack("faults")


def _record(event: str, ctx: ToolContext, tool: str) -> None:
    path = os.environ.get("FAULTS_RUNS_LOG")
    if not path:
        return
    line = f"{event} {ctx.task_id or '-'} {os.getpid()} {tool}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


async def _work(ctx: ToolContext, seconds: float, label: str, tool: str) -> str:
    _record("start", ctx, tool)
    await asyncio.sleep(seconds)
    _record("end", ctx, tool)
    return f"worked {label}"


@pack.tool(rerunnable=True)
async def work(ctx: ToolContext, seconds: float = 0.2, label: str = "") -> str:
    """Sleeps ``seconds`` and records its start and end; safe to run again after a crash."""
    return await _work(ctx, seconds, label, "work")


@pack.tool()
async def work_once(ctx: ToolContext, seconds: float = 0.2, label: str = "") -> str:
    """Sleeps ``seconds`` and records its start and end; must never run twice."""
    return await _work(ctx, seconds, label, "work_once")


def _lines(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            return [line.split() for line in f.read().splitlines()]
    except FileNotFoundError:
        return []


def executions(path: str) -> dict[str, dict[str, list[int]]]:
    """task id -> {"start": [pids], "end": [pids]}, from the log the tools above wrote."""
    runs: dict[str, dict[str, list[int]]] = {}
    for event, task_id, pid, _tool in _lines(path):
        runs.setdefault(task_id, {"start": [], "end": []})[event].append(int(pid))
    return runs


def events(path: str) -> dict[str, list[tuple[str, int]]]:
    """task id -> its starts and ends in the order they were written, as (event, pid)."""
    ordered: dict[str, list[tuple[str, int]]] = {}
    for event, task_id, pid, _tool in _lines(path):
        ordered.setdefault(task_id, []).append((event, int(pid)))
    return ordered


def not_rerunnable(path: str) -> set[str]:
    """The tasks of the log that ran ``work_once`` (whether or not a client heard of them)."""
    return {task_id for _event, task_id, _pid, tool in _lines(path) if tool == "work_once"}
