"""Issue 45, items 5 and 6: `mcp-tasks usage` and `mcp-tasks audit trail` against the audit record a
real hosted server wrote for two tenants (each with a subject named alice), and the plain calls it
counted on both wires."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import secrets
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from tests.conftest import http_client, make_settings, run_issuer, serve
from tests.ext import V2026Client
from tests.issuer import LocalIssuer
from tests.rpc import RpcSession
from tests.test_durability import ROOT

pytestmark = pytest.mark.slow


def mcp(database_url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCP_TASKS_")}
    done = subprocess.run(
        [sys.executable, "-m", "service", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**env, "MCP_TASKS_DATABASE_URL": database_url},
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done


def lines(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


async def _until_expired(database_url: str, task_id: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        async with asyncio.timeout(30):
            while not await conn.fetchval("SELECT count(*) FROM audit_events WHERE task_id = $1 AND action = 'expire'",
                                          task_id):  # fmt: skip
                await asyncio.sleep(0.1)
    finally:
        await conn.close()


@pytest.fixture(scope="module")
async def record(admin_dsn: str, template_db: str) -> Any:
    """One record for the module: tenant A ran five tasks (completed, tool error, failed, cancelled,
    expired while waiting for input) and two plain calls (2025-11-25, 2025-06-18), tenant B one task
    and one plain call (2026-07-28), and B asked for one of A's tasks. The server stops before the
    tests read (its last maintenance pass writes the plain calls)."""
    from tests.conftest import fresh_database

    started = datetime.now(UTC).isoformat()
    async with fresh_database(admin_dsn, template_db) as url, run_issuer(LocalIssuer()) as issuer:
        settings = make_settings(url, auth="oauth", oauth_issuer=issuer.url)
        async with serve(settings) as server, http_client() as http:
            a = RpcSession(http, server.url, token=issuer.mint(server.url, tenant_id="t-a", sub="alice"))
            b = RpcSession(http, server.url, token=issuer.mint(server.url, tenant_id="t-b", sub="alice"))
            await a.initialize()
            await b.initialize()
            ids = {}
            for name, args in (("echo", {"text": "x"}), ("fail", {"message": "no"}), ("crash", {"message": "no"})):
                ids[name] = (await a.call_tool_as_task(name, args))["task"]["taskId"]
                await a.send("tasks/result", {"taskId": ids[name]})  # waits for the end, whatever it is
            ids["hang"] = (await a.call_tool_as_task("hang", {}))["task"]["taskId"]
            await a.result("tasks/cancel", {"taskId": ids["hang"]})
            # A task waiting for input is kept its ttl from then (a working one is never expired).
            ids["expiring"] = (await a.call_tool_as_task("confirm", {}, {"ttl": 1_000}))["task"]["taskId"]
            b_echo = (await b.call_tool_as_task("echo", {"text": "y"}))["task"]["taskId"]
            await b.result("tasks/result", {"taskId": b_echo})
            await b.error("tasks/get", {"taskId": ids["echo"]})  # B probes A's task: a denial in B's chain
            # Plain calls: answered inside their requests, on each wire.
            await a.result("tools/call", {"name": "echo", "arguments": {"text": "plain"}})
            older = RpcSession(http, server.url, token=a.token)
            await older.initialize("2025-06-18")
            await older.result("tools/call", {"name": "echo", "arguments": {"text": "plain"}})
            # Declaring no Tasks extension: answered inside its request however long the echo takes
            # (a declaring call becomes a task after the grace, 500 ms, which a loaded machine can pass).
            modern = V2026Client(http, server.url, token=b.token, capabilities={})
            answered = await modern.result("tools/call", {"name": "echo", "arguments": {"text": "plain"}})
            assert answered["resultType"] == "complete", answered  # ended inside its request
            await _until_expired(url, ids["expiring"])
        yield url, ids, started


async def test_usage_counts_each_tenants_tasks_by_how_they_ended(record: Any) -> None:
    url, _ids, started = record
    rows = {r["tenant"]: r for r in lines(await asyncio.to_thread(mcp, url, "usage", "--since", started, "--json"))}
    assert set(rows) == {"t-a", "t-b"}
    a = rows["t-a"]
    # A tool error is a result (completed); the crash failed; the cancel and the expiry are theirs.
    assert (a["created"], a["completed"], a["failed"], a["cancelled"], a["expired"]) == (5, 2, 1, 1, 1)
    assert a["task_seconds"] > 0
    assert (rows["t-b"]["created"], rows["t-b"]["completed"]) == (1, 1)
    # Plain calls, per tenant (the hours the range touches): A's on 2025-11-25 and 2025-06-18, B's on 2026-07-28.
    assert (a["plain_calls"], rows["t-b"]["plain_calls"]) == (2, 1)


async def test_usage_by_tool_as_csv_and_an_empty_range(record: Any) -> None:
    url, _ids, started = record
    by_tool = await asyncio.to_thread(mcp, url, "usage", "--tenant", "t-a", "--by", "tool", "--csv", "--since", started)
    assert by_tool.returncode == 0, by_tool.stderr
    table = list(csv.DictReader(io.StringIO(by_tool.stdout)))
    assert {r["tool"] for r in table} == {"echo", "fail", "crash", "hang", "confirm"}
    assert sum(int(r["created"]) for r in table) == 5
    assert {r["tool"]: int(r["plain_calls"]) for r in table if int(r["plain_calls"])} == {"echo": 2}
    empty = await asyncio.to_thread(mcp, url, "usage", "--since", "2099-01-01T00:00:00+00:00", "--csv")
    assert (empty.returncode, empty.stdout.splitlines()[1:]) == (0, [])  # the header only
    bad = await asyncio.to_thread(mcp, url, "usage", "--since", "last tuesday")
    assert (bad.returncode, bad.stdout) == (2, "")


async def test_a_task_trail_shows_its_tenants_rows_in_chain_order_and_no_other_tenants(record: Any) -> None:
    url, ids, _started = record
    trail = lines(await asyncio.to_thread(mcp, url, "audit", "trail", "--task", ids["echo"], "--json"))
    assert {r["tenant_id"] for r in trail} == {"t-a"}  # B's probe of this id stays in B's chain
    assert [r["action"] for r in trail][:2] == ["create", "complete"]
    assert all(len(r["hash"]) == 64 and len(r["prev_hash"]) == 64 for r in trail)
    assert [r["seq"] for r in trail] == sorted(r["seq"] for r in trail)
    probe = lines(
        await asyncio.to_thread(mcp, url, "audit", "trail", "--task", ids["echo"], "--tenant", "t-b", "--json")
    )
    assert [(r["tenant_id"], r["action"]) for r in probe] == [("t-b", "deny")]
    verify = await asyncio.to_thread(mcp, url, "audit", "verify", "--tenant", "t-a")
    assert verify.returncode == 0  # the chain the rows' positions point into is intact
    table = await asyncio.to_thread(mcp, url, "audit", "trail", "--task", ids["echo"])
    assert table.stdout.splitlines()[0].split()[:3] == ["tenant_id", "seq", "hash"]


async def test_a_subject_trail_never_mixes_tenants(record: Any) -> None:
    url, _ids, started = record
    ambiguous = await asyncio.to_thread(mcp, url, "audit", "trail", "--subject", "alice", "--since", started)
    assert (ambiguous.returncode, ambiguous.stdout) == (2, "")  # alice of t-a and alice of t-b are two people
    rows = lines(
        await asyncio.to_thread(
            mcp, url, "audit", "trail", "--subject", "alice", "--tenant", "t-b", "--since", started, "--json"
        )
    )
    assert rows
    assert {(r["tenant_id"], r["subject"]) for r in rows} == {("t-b", "alice")}
    no_since = await asyncio.to_thread(mcp, url, "audit", "trail", "--subject", "alice", "--tenant", "t-b")
    assert no_since.returncode == 2


async def test_a_login_without_the_services_roles_reads_no_trail(record: Any, admin_dsn: str) -> None:
    url, ids, _started = record
    role = f"op_reviewer_{secrets.token_hex(4)}"
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE ROLE "{role}" LOGIN')
        outsider = url.replace("postgres@", f"{role}@", 1)
        done = await asyncio.to_thread(mcp, outsider, "audit", "trail", "--task", ids["echo"], "--tenant", "t-a")
    finally:
        await conn.execute(f'DROP ROLE IF EXISTS "{role}"')
        await conn.close()
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1


async def test_plain_calls_a_flush_could_not_write_wait_for_the_next_and_processes_add_up(database_url: str) -> None:
    """A process's counts outlive a flush that fails (the database gone): the next flush writes
    them, and two processes' counts of one tenant, tool and hour add up in one row."""
    from service.store.db import RUNNER_ROLE, Database
    from service.store.usage import PlainCallTally, UsageStore

    one, other = PlainCallTally(), PlainCallTally()
    for _ in range(3):
        one.count("t-a", "echo")
    other.count("t-a", "echo")
    gone = Database(database_url, pool_size=1, role=RUNNER_ROLE)
    await gone.open()
    await gone.close()
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the closed pool raises
        await one.flush(gone)
    db = Database(database_url, pool_size=2, role=RUNNER_ROLE)
    await db.open()
    try:
        assert (await one.flush(db), await other.flush(db), await one.flush(db)) == (3, 1, 0)
        report = await UsageStore(db).report("t-a", None, None)
    finally:
        await db.close()
    assert [(u.tool, u.plain_calls, u.created) for u in report] == [("echo", 4, 0)]
