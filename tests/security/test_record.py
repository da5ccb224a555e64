"""Issue 14, finding 5: connected as the service's own roles, a statement could rewrite a finished
task's result and append backdated audit rows plus a head update that `mcp-tasks audit verify`
called intact. Every forgery is tried again here, as each role (the login user acting as it, as
the service does); what still succeeds is exactly what SECURITY.md says a holder of the service's
database credentials can do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson
import pytest

from service.store.db import APP_ROLE, RUNNER_ROLE
from tests.conftest import http_client, make_settings, serve
from tests.rpc import RpcSession
from tests.security.conftest import ClosedDatabase, owned_by_a_non_superuser
from tests.test_audit import broken, mcp_tasks_audit

ROLES = [APP_ROLE, RUNNER_ROLE]
VICTIM_TEXT = "the genuine result"


@dataclass(frozen=True)
class Scene:
    url: str
    session: RpcSession
    tenant: str
    finished: str  # a completed task's id
    running: str  # a task still working (leased by the server's runner)


@pytest.fixture(scope="module")
async def scene(closed_db: ClosedDatabase) -> AsyncIterator[Scene]:
    """The service (logged in as its own user) with one finished and one running task."""
    async with http_client(30) as http, serve(make_settings(closed_db.service_url)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        finished = (await s.call_tool_as_task("echo", {"text": VICTIM_TEXT}))["task"]["taskId"]
        assert (await s.result("tasks/result", {"taskId": finished}))["content"][0]["text"] == VICTIM_TEXT
        hanging = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        admin = await asyncpg.connect(closed_db.admin_url)
        try:
            async with asyncio.timeout(10):
                while await admin.fetchval("SELECT lease_owner FROM tasks WHERE task_id = $1", hanging) is None:
                    await asyncio.sleep(0.05)
            tenant = await admin.fetchval("SELECT tenant_id FROM tasks WHERE task_id = $1", finished)
        finally:
            await admin.close()
        yield Scene(running.url, s, tenant, finished, hanging)


async def in_tenant(conn: asyncpg.Connection, tenant: str) -> None:
    """Choose a tenant as any holder of the credentials can: set_config in their own transaction."""
    await conn.execute("BEGIN")
    await conn.execute("SELECT set_config('app.tenant_id', $1, true)", tenant)


async def refused(conn: asyncpg.Connection, sql: str, *args: Any) -> None:
    """The statement is refused for lack of privilege (not merely matching no row)."""
    await conn.execute("SAVEPOINT attempt")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await conn.execute(sql, *args)
    await conn.execute("ROLLBACK TO SAVEPOINT attempt")


async def verify_intact(closed_db: ClosedDatabase, tenant: str) -> None:
    done = await mcp_tasks_audit(closed_db.service_url, "verify", "--tenant", tenant)
    assert done.returncode == 0, done.stdout + done.stderr
    assert broken(done.stdout) == set()


@pytest.mark.parametrize("role", ROLES)
async def test_no_service_role_can_insert_a_backdated_event_move_a_head_or_remove_events(
    closed_db: ClosedDatabase, scene: Scene, role: str
) -> None:
    """Finding 5: a backdated INSERT plus an audit_heads UPDATE passed `audit verify`. Both are
    refused now, as are DELETE, TRUNCATE, switching the append-only trigger off and acting as the
    role that owns the record."""
    conn = await closed_db.connect_as(role)
    try:
        await in_tenant(conn, scene.tenant)
        assert await conn.fetchval("SELECT count(*) FROM audit_events") > 0  # visible: refusals are real
        await refused(
            conn,
            """INSERT INTO audit_events (tenant_id, seq, at, action, outcome, prev_hash, hash)
               SELECT tenant_id, seq + 1, '2020-01-01', 'complete', 'completed', hash, hash FROM audit_heads
               WHERE tenant_id = $1""",
            scene.tenant,
        )
        await refused(conn, "UPDATE audit_heads SET seq = seq + 1 WHERE tenant_id = $1", scene.tenant)
        await refused(conn, "DELETE FROM audit_events WHERE tenant_id = $1", scene.tenant)
        await refused(conn, "TRUNCATE audit_events")
        await refused(conn, "ALTER TABLE audit_events DISABLE TRIGGER audit_events_no_update_delete")
        await refused(conn, "SET ROLE mcp_tasks_record")
        await refused(conn, "ALTER FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb) "
                            "SECURITY INVOKER")  # fmt: skip
        # Issue 42 §4: only the export path says how far a chain was written out (which is what lets
        # a purge remove rows), so marking everything exported, then purging, erased a tenant's record.
        await refused(conn, "SELECT audit_mark_exported($1, 1000000)", scene.tenant)
        await refused(conn, "SELECT audit_mark_exported_v2($1, 1000000)", scene.tenant)
        if role == APP_ROLE:  # retention is the runner's (maintenance, `audit export --purge-before`)
            await refused(conn, "SELECT audit_purge($1, now())", scene.tenant)
        else:  # nothing was exported: nothing may be purged
            assert await conn.fetchval("SELECT audit_purge($1, now())", scene.tenant) == 0
        await conn.execute("ROLLBACK")
    finally:
        await conn.close()
    await verify_intact(closed_db, scene.tenant)


async def test_audit_append_dates_events_itself_and_only_for_the_transactions_tenant(
    closed_db: ClosedDatabase, scene: Scene
) -> None:
    """The function takes the time (no parameter for it) and never dates an event before its
    chain's last one. The app role appends only to the tenant its transaction names: choosing a
    tenant is a set_config away for a holder of the credentials (SECURITY.md), so such an event is
    in the chain, hash-linked and dated now, never hidden or backdated."""
    conn = await closed_db.connect_as(APP_ROLE)
    try:
        await in_tenant(conn, "someone-else")
        await refused(
            conn, "SELECT audit_append($1, 'deny', 'forged', '', '', '', NULL, NULL, NULL, NULL)", scene.tenant
        )
        await conn.execute("ROLLBACK")
        await in_tenant(conn, scene.tenant)
        seq = await conn.fetchval(
            "SELECT audit_append($1, 'deny', 'forged', '', '', '', NULL, NULL, NULL, NULL)", scene.tenant
        )
        row = await conn.fetchrow(
            """SELECT e.at, e.at >= clock_timestamp() - interval '5 seconds' AS recent,
                      e.at >= (SELECT max(p.at) FROM audit_events p WHERE p.tenant_id = e.tenant_id
                               AND p.seq < e.seq) AS in_order
               FROM audit_events e WHERE tenant_id = $1 AND seq = $2""",
            scene.tenant,
            seq,
        )
        assert row["recent"], dict(row)
        assert row["in_order"], dict(row)
        await conn.execute("COMMIT")
    finally:
        await conn.close()
    await verify_intact(closed_db, scene.tenant)


@pytest.mark.parametrize("role", ROLES)
async def test_no_service_role_can_rewrite_a_finished_tasks_outcome(
    closed_db: ClosedDatabase, scene: Scene, role: str
) -> None:
    """Finding 5: a statement rewrote a stored result ("FORGED") that another principal's
    tasks/result then returned. Outcome columns are the record's only; a finished row is not
    changed at all, not deleted before it expires, and no row is inserted already finished."""
    conn = await closed_db.connect_as(role)
    forged = orjson.dumps({"content": [{"type": "text", "text": "FORGED"}]}).decode()
    try:
        await in_tenant(conn, scene.tenant)
        where = (scene.tenant, scene.finished)
        await refused(
            conn, "UPDATE tasks SET payload = $3::jsonb WHERE tenant_id = $1 AND task_id = $2", *where, forged
        )
        await refused(conn, "UPDATE tasks SET outcome = 'tool_error' WHERE tenant_id = $1 AND task_id = $2", *where)
        for change in ("status_message = 'FORGED'", "status = 'cancelled'", "finished_at = now()"):
            sql = f"UPDATE tasks SET {change} WHERE tenant_id = $1 AND task_id = $2"
            if role == RUNNER_ROLE and change.startswith("finished_at"):
                await refused(conn, sql, *where)  # a column the runner never writes directly
            else:
                assert await conn.execute(sql, *where) == "UPDATE 0", change
        assert await conn.execute("DELETE FROM tasks WHERE tenant_id = $1 AND task_id = $2", *where) == "DELETE 0"
        await refused(
            conn,
            """INSERT INTO tasks (tenant_id, task_id, subject, wire, tool, arguments, ttl_ms, poll_interval_ms,
                                  expires_at, status, outcome, payload)
               SELECT tenant_id, task_id || '-again', subject, wire, tool, arguments, ttl_ms, poll_interval_ms,
                      expires_at, 'completed', 'result', $3::jsonb FROM tasks WHERE tenant_id = $1 AND task_id = $2""",
            *where,
            forged,
        )
        item = {"tenant_id": scene.tenant, "task_id": scene.finished, "owner": "forger", "status": "completed",
                "outcome": "result", "payload": orjson.loads(forged), "status_message": None, "detail": None}  # fmt: skip
        release = {"tenant_id": scene.tenant, "task_id": scene.finished, "owner": "forger", "rerunnable": True,
                   "max_attempts": 9, "requeue_message": "x", "failure": {"message": "FORGED"}}  # fmt: skip
        if role == RUNNER_ROLE:
            for fn, body in (("task_finish", item), ("task_hand_back", release)):
                moved = await conn.fetchrow(f"SELECT * FROM {fn}($1::jsonb)", orjson.dumps([body]).decode())
                assert moved["task_id"] is None, fn  # the lease check: not this owner's, not active
        else:
            await refused(conn, "SELECT * FROM task_finish($1::jsonb)", orjson.dumps([item]).decode())
        await conn.execute("ROLLBACK")
    finally:
        await conn.close()
    result = await scene.session.result("tasks/result", {"taskId": scene.finished})
    assert result["content"][0]["text"] == VICTIM_TEXT


async def test_what_the_credentials_still_can_do_is_what_security_md_says(
    closed_db: ClosedDatabase, scene: Scene
) -> None:
    """SECURITY.md, "What a holder of the service's database credentials can do": choose any tenant
    and read its rows (set_config; the runner role reads all tenants), and finish an active task as
    its runner would (reading the lease owner and epoch first), which the chain records as a complete."""
    app = await closed_db.connect_as(APP_ROLE)
    runner = await closed_db.connect_as(RUNNER_ROLE)
    try:
        await in_tenant(app, scene.tenant)
        stored = await app.fetchval("SELECT payload FROM tasks WHERE task_id = $1", scene.finished)
        assert VICTIM_TEXT in stored
        await app.execute("ROLLBACK")
        assert await runner.fetchval("SELECT count(*) FROM tasks WHERE task_id = $1", scene.finished) == 1
        owner, epoch = await runner.fetchrow(
            "SELECT lease_owner, lease_epoch FROM tasks WHERE task_id = $1", scene.running
        )
        item = {"tenant_id": scene.tenant, "task_id": scene.running, "owner": owner, "epoch": epoch,
                "status": "completed", "outcome": "result",
                "payload": {"content": [{"type": "text", "text": "finished by a forger"}]},
                "status_message": None, "detail": None}  # fmt: skip
        done = await runner.fetchrow("SELECT * FROM task_finish($1::jsonb)", orjson.dumps([item]).decode())
        assert done["task_id"] == scene.running
        recorded = await runner.fetchval(
            "SELECT count(*) FROM audit_events WHERE tenant_id = $1 AND task_id = $2 AND action = 'complete'",
            scene.tenant,
            scene.running,
        )
        assert recorded == 1
    finally:
        await app.close()
        await runner.close()
    await verify_intact(closed_db, scene.tenant)


async def test_verify_reports_a_chain_whose_time_goes_back(closed_db: ClosedDatabase) -> None:
    """`mcp-tasks audit verify` also checks that timestamps never go back within a chain: a chain
    rebuilt with consistent hashes (by the database's owner) but a backdated row is reported."""
    admin = await asyncpg.connect(closed_db.admin_url)
    try:
        await admin.execute(
            """DO $$
               DECLARE e audit_events; prev bytea := decode(repeat('00', 32), 'hex');
               BEGIN
                   FOR i IN 1 .. 3 LOOP
                       e := ROW('backdated', i, now() - CASE WHEN i = 2 THEN interval '1 day' ELSE interval '0' END,
                                'deny', 'x', '', '', '', NULL, NULL, NULL, NULL, prev, prev)::audit_events;
                       e.hash := sha256(prev || convert_to(audit_canonical(e), 'UTF8'));
                       INSERT INTO audit_events VALUES (e.*);
                       prev := e.hash;
                   END LOOP;
                   INSERT INTO audit_heads (tenant_id, seq, hash) VALUES ('backdated', 3, prev);
               END $$"""
        )
        done = await mcp_tasks_audit(closed_db.service_url, "verify", "--tenant", "backdated")
        assert done.returncode == 1, done.stdout + done.stderr
        assert broken(done.stdout) == {("backdated", 2)}
        assert "time goes back" in done.stdout
    finally:
        await admin.close()


async def test_a_schema_owner_that_is_not_a_superuser_migrates_and_hands_the_record_to_its_role(
    admin_dsn: str,
) -> None:
    """docs/operations.md: migrations run as the database's owner (CREATEROLE, not a superuser). It
    may give the record's functions to mcp_tasks_record: the migration makes it a member first."""
    async with owned_by_a_non_superuser(admin_dsn) as (_admin_url, url, _owner):
        conn = await asyncpg.connect(url)
        try:
            owners = await conn.fetch(
                """SELECT proname, pg_get_userbyid(proowner) AS owner, prosecdef FROM pg_proc
                   WHERE proname IN ('audit_append', 'audit_append_events', 'audit_purge', 'task_finish',
                                      'task_hand_back')"""
            )
        finally:
            await conn.close()
        # audit_append runs as its caller and appends through audit_append_events, which runs as the record.
        assert {(r["proname"], r["owner"], r["prosecdef"]) for r in owners} == {
            *((name, "mcp_tasks_record", True) for name in (
                "audit_append_events", "audit_purge", "task_finish", "task_hand_back")),
            ("audit_append", "mcp_tasks_record", False),
        }  # fmt: skip
