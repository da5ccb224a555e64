"""Issue 14, finding 7: `tasks/result` of a finished task wrote an audit row per retrieval (about
0.6 GB a day per polling principal) and nothing was ever purged. Repeats are now recorded once per
requestor per interval, and retention purges only what `mcp-tasks audit export` wrote out,
leaving a chain that still verifies (docs/decisions.md, "Audit retention")."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx

from service.store.db import RUNNER_ROLE
from tests.conftest import make_settings, serve
from tests.rpc import RpcSession
from tests.security.conftest import ClosedDatabase
from tests.test_audit import broken, mcp_tasks_audit


async def old_chain(closed_db: ClosedDatabase, tenant: str, n: int, days_ago: int) -> None:
    """``n`` events of ``tenant`` dated ``days_ago`` days back, hash-linked as audit_append links
    them (written by the database's owner: no role of the service may date an event)."""
    admin = await asyncpg.connect(closed_db.admin_url)
    try:
        await admin.execute(
            f"""DO $$
                DECLARE e audit_events; prev bytea := decode(repeat('00', 32), 'hex');
                BEGIN
                    FOR i IN 1 .. {n} LOOP
                        e := ROW('{tenant}', i, now() - interval '{days_ago} days' + i * interval '1 second',
                                 'deny', 'x', '', '', '', NULL, NULL, NULL, NULL, prev, prev)::audit_events;
                        e.hash := sha256(prev || convert_to(audit_canonical(e), 'UTF8'));
                        INSERT INTO audit_events VALUES (e.*);
                        prev := e.hash;
                    END LOOP;
                    INSERT INTO audit_heads (tenant_id, seq, hash, at) VALUES ('{tenant}', {n}, prev, e.at);
                END $$"""
        )
    finally:
        await admin.close()


async def chain(closed_db: ClosedDatabase, tenant: str) -> list[asyncpg.Record]:
    admin = await asyncpg.connect(closed_db.admin_url)
    try:
        return await admin.fetch(
            "SELECT seq, action, detail, prev_hash, hash FROM audit_events WHERE tenant_id = $1 ORDER BY seq", tenant
        )
    finally:
        await admin.close()


async def assert_verifies(closed_db: ClosedDatabase, tenant: str) -> None:
    done = await mcp_tasks_audit(closed_db.service_url, "verify", "--tenant", tenant)
    assert done.returncode == 0, done.stdout + done.stderr
    assert broken(done.stdout) == set()


async def test_export_with_purge_before_removes_what_it_wrote_and_the_chain_still_verifies(
    closed_db: ClosedDatabase,
) -> None:
    await old_chain(closed_db, "exported", 3, days_ago=10)
    cutoff = (datetime.now(UTC) - timedelta(days=5)).isoformat()
    done = await mcp_tasks_audit(closed_db.service_url, "export", "--tenant", "exported", "--purge-before", cutoff)
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["seq"] for e in written] == [1, 2, 3]
    assert "purged 3" in done.stderr
    left = await chain(closed_db, "exported")
    # Only the purge itself is left, linked to the last purged row (the checkpoint in the head).
    assert [(r["seq"], r["action"]) for r in left] == [(4, "purge")]
    assert left[0]["prev_hash"].hex() == written[-1]["hash"]
    assert json.loads(left[0]["detail"])["through_seq"] == 3
    await assert_verifies(closed_db, "exported")
    # The next export starts where the last one ended: together they verify offline too.
    again = await mcp_tasks_audit(closed_db.service_url, "export", "--tenant", "exported")
    assert [json.loads(line)["prev_hash"] for line in again.stdout.splitlines()] == [written[-1]["hash"]]


async def test_the_maintenance_pass_purges_only_exported_events_past_retention(
    closed_db: ClosedDatabase, http: httpx.AsyncClient
) -> None:
    """MCP_TASKS_AUDIT_RETENTION_DAYS: old events go only once exported (the export marker); old
    events no export covered stay, and so does a tenant's chain that was never exported."""
    await old_chain(closed_db, "partly", 5, days_ago=10)
    await old_chain(closed_db, "never", 2, days_ago=10)
    runner = await closed_db.connect_as(RUNNER_ROLE)
    try:
        await runner.execute("SELECT audit_mark_exported('partly', 3)")  # as an export of rows 1-3 does
    finally:
        await runner.close()
    async with serve(make_settings(closed_db.service_url, audit_retention_days=5)):
        async with asyncio.timeout(20):  # the first maintenance pass purges at start
            while [r["seq"] for r in await chain(closed_db, "partly")][:1] != [4]:
                await asyncio.sleep(0.1)
    assert [(r["seq"], r["action"]) for r in await chain(closed_db, "partly")] == [
        (4, "deny"),
        (5, "deny"),
        (6, "purge"),
    ]
    assert [r["seq"] for r in await chain(closed_db, "never")] == [1, 2]
    for tenant in ("partly", "never"):
        await assert_verifies(closed_db, tenant)


async def test_purge_before_refuses_a_partial_export(closed_db: ClosedDatabase) -> None:
    """Only rows written out from the start of their chain may be purged: not with --since."""
    since = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    done = await mcp_tasks_audit(closed_db.service_url, "export", "--since", since, "--purge-before", since)
    assert done.returncode == 2
    assert done.stdout == ""


async def retrieves(closed_db: ClosedDatabase, task_id: str) -> int:
    admin = await asyncpg.connect(closed_db.admin_url)
    try:
        count: int = await admin.fetchval(
            "SELECT count(*) FROM audit_events WHERE task_id = $1 AND action = 'retrieve'", task_id
        )
        return count
    finally:
        await admin.close()


async def test_repeated_retrievals_of_a_finished_task_are_recorded_once_per_interval(
    closed_db: ClosedDatabase, http: httpx.AsyncClient
) -> None:
    """Finding 7: one audit row per `tasks/result` of a finished task. Now one per requestor per
    MCP_TASKS_AUDIT_RETRIEVE_INTERVAL_S (repeats counted, reported in the next row); 0 records every one."""
    for interval, expected in ((3_600, 1), (0, 5)):
        async with serve(make_settings(closed_db.service_url, audit_retrieve_interval_s=interval)) as running:
            s = RpcSession(http, running.url)
            await s.initialize()
            task_id = (await s.call_tool_as_task("echo", {"text": "polled"}))["task"]["taskId"]
            for _ in range(5):
                assert (await s.result("tasks/result", {"taskId": task_id}))["content"][0]["text"] == "polled"
        assert await retrieves(closed_db, task_id) == expected, interval
    admin = await asyncpg.connect(closed_db.admin_url)
    try:
        assert await admin.fetchval("SELECT max(repeats) FROM audit_retrievals") == 4
    finally:
        await admin.close()
