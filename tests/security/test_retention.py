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
import pytest

from service.store.db import APP_ROLE, EXPORTER_ROLE, RUNNER_ROLE
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
    # Only the export path marks a chain written out: the service's own login cannot (issue 42 §4).
    as_service = await mcp_tasks_audit(
        closed_db.service_url, "export", "--tenant", "exported", "--purge-before", cutoff
    )
    assert as_service.returncode == 1
    assert as_service.stdout == ""  # refused before anything was written out
    assert "cannot act as mcp_tasks_exporter" in as_service.stderr
    assert "Traceback" not in as_service.stderr
    done = await mcp_tasks_audit(closed_db.exporter_url, "export", "--tenant", "exported", "--purge-before", cutoff)
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["seq"] for e in written] == [1, 2, 3]
    assert "purged 3" in done.stderr
    left = await chain(closed_db, "exported")
    # The export's own event (how far, by which login) and the purge are left, linked to the last
    # purged row (the checkpoint in the head).
    assert [(r["seq"], r["action"]) for r in left] == [(4, "export"), (5, "purge")]
    assert left[0]["prev_hash"].hex() == written[-1]["hash"]
    assert json.loads(left[0]["detail"])["through_seq"] == 3
    assert json.loads(left[0]["detail"])["login"].startswith("mcp_tasks_export_")
    assert json.loads(left[1]["detail"])["through_seq"] == 3
    await assert_verifies(closed_db, "exported")
    # The next export starts where the last one ended: together they verify offline too.
    again = await mcp_tasks_audit(closed_db.exporter_url, "export", "--tenant", "exported")
    assert next(json.loads(line)["prev_hash"] for line in again.stdout.splitlines()) == written[-1]["hash"]


async def test_the_maintenance_pass_purges_only_exported_events_past_retention(
    closed_db: ClosedDatabase, http: httpx.AsyncClient
) -> None:
    """MCP_TASKS_AUDIT_RETENTION_DAYS: old events go only once exported (the export marker); old
    events no export covered stay, and so does a tenant's chain that was never exported."""
    await old_chain(closed_db, "partly", 5, days_ago=10)
    await old_chain(closed_db, "never", 2, days_ago=10)
    exporter = await asyncpg.connect(closed_db.exporter_url, server_settings={"role": EXPORTER_ROLE})
    try:
        await exporter.execute("SELECT audit_mark_exported_v2('partly', 3)")  # as an export of rows 1-3 does
    finally:
        await exporter.close()
    async with serve(make_settings(closed_db.service_url, audit_retention_days=5)):
        async with asyncio.timeout(20):  # the first maintenance pass purges at start
            while [r["seq"] for r in await chain(closed_db, "partly")][:1] != [4]:
                await asyncio.sleep(0.1)
    assert [(r["seq"], r["action"]) for r in await chain(closed_db, "partly")] == [
        (4, "deny"),
        (5, "deny"),
        (6, "export"),
        (7, "purge"),
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


async def test_the_runner_cannot_erase_a_tenants_record_and_verify_reports_a_purge_no_export_covered(
    closed_db: ClosedDatabase,
) -> None:
    """Issue 42 §4, the attack: as mcp_tasks_runner, audit_mark_exported(T, max) with nothing
    exported, then audit_purge(T, now()), deleted all 56 events and verify said "intact". Marking is
    refused now (for the app role too) and the purge removes nothing. Should a purge still happen
    without an export (the database's owner moving the mark by hand), verify names it."""
    await old_chain(closed_db, "victim", 56, days_ago=1)
    for role in (RUNNER_ROLE, APP_ROLE):
        conn = await closed_db.connect_as(role)
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("SELECT audit_mark_exported('victim', 9223372036854775807)")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("SELECT audit_mark_exported_v2('victim', 9223372036854775807)")
            if role == RUNNER_ROLE:  # retention's: removes only what an export covered, here nothing
                assert await conn.fetchval("SELECT audit_purge('victim', now())") == 0
        finally:
            await conn.close()
    assert len(await chain(closed_db, "victim")) == 56
    await assert_verifies(closed_db, "victim")

    admin = await asyncpg.connect(closed_db.admin_url)
    try:  # what only the database's owner can still do: move the mark without an export
        await admin.execute("UPDATE audit_heads SET exported_seq = seq WHERE tenant_id = 'victim'")
    finally:
        await admin.close()
    runner = await closed_db.connect_as(RUNNER_ROLE)
    try:
        assert await runner.fetchval("SELECT audit_purge('victim', now())") == 56
    finally:
        await runner.close()
    done = await mcp_tasks_audit(closed_db.service_url, "verify", "--tenant", "victim")
    assert done.returncode == 1
    assert "purge of rows no export covered (through seq 56)" in done.stdout
