"""Issue 42 §5: a result or error handed out on the 2026-07-28 wire (inline in `tasks/get`, in a
listen's snapshot or notification) leaves a `retrieve` audit row, under the same once-per-interval
rule as 2025-11-25's `tasks/result`."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import httpx

from tests.conftest import RunningServer
from tests.ext import V2026Client


async def retrieves(database_url: str, task_id: str) -> list[dict[str, Any]]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT outcome, request_id FROM audit_events WHERE action = 'retrieve' AND task_id = $1", task_id
        )
    finally:
        await conn.close()
    return [dict(r) for r in rows]


async def test_a_2026_result_handed_out_inline_or_to_a_listen_is_audited_once_per_interval(
    server: RunningServer, database_url: str, http: httpx.AsyncClient
) -> None:
    c = V2026Client(http, server.url)
    polled = (await c.result("tools/call", {"name": "sleep", "arguments": {"seconds": 1.5}}))["taskId"]
    listened = (await c.result("tools/call", {"name": "sleep", "arguments": {"seconds": 1.5}}))["taskId"]
    assert await retrieves(database_url, polled) == []  # nothing handed out yet
    async with asyncio.timeout(20):
        while (got := await c.result("tasks/get", {"taskId": polled}))["status"] != "completed":
            await asyncio.sleep(0.05)
    assert got["result"]["content"][0]["text"] == "slept 1.5s"
    assert [r["outcome"] for r in await retrieves(database_url, polled)] == ["completed"]
    for _ in range(3):  # handed out again within the interval: no new row
        assert (await c.result("tasks/get", {"taskId": polled}))["status"] == "completed"
    assert len(await retrieves(database_url, polled)) == 1

    async with asyncio.timeout(20):
        async for msg in c.listen([listened]):
            if msg["method"] == "notifications/tasks" and msg["params"]["status"] == "completed":
                assert msg["params"]["result"]["content"][0]["text"] == "slept 1.5s"
                break
    assert [r["outcome"] for r in await retrieves(database_url, listened)] == ["completed"]
