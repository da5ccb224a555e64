"""Row-level security is a second wall: raw SQL through the service's roles (T-SEC-1/2)."""

from __future__ import annotations

import secrets

import asyncpg
import pytest

from service.domain.errors import InvalidArguments
from service.store.db import APP_ROLE, RUNNER_ROLE, Database
from tests.conftest import RunningServer

INSERT_TASK = """
INSERT INTO tasks (tenant_id, task_id, subject, wire, tool, arguments, ttl_ms, poll_interval_ms, expires_at)
VALUES ($1, $2, 's', '2025-11-25', 'echo', '{}', 60000, 1000, now() + interval '1 minute')
"""


async def as_role(database_url: str, role: str) -> asyncpg.Connection:
    return await asyncpg.connect(database_url, server_settings={"role": role})


async def in_tenant(conn: asyncpg.Connection, tenant: str | None) -> None:
    await conn.execute("BEGIN")
    if tenant is not None:
        await conn.execute("SELECT set_config('app.tenant_id', $1, true)", tenant)


@pytest.fixture
async def two_tenants(database_url: str) -> None:
    conn = await as_role(database_url, APP_ROLE)
    try:
        for tenant in ("acme", "globex"):
            await in_tenant(conn, tenant)
            await conn.execute(INSERT_TASK, tenant, f"{tenant}-task")
            await conn.execute("COMMIT")
    finally:
        await conn.close()


async def test_the_app_role_sees_only_its_tenants_rows(database_url: str, two_tenants: None) -> None:
    conn = await as_role(database_url, APP_ROLE)
    try:
        assert await conn.fetchval("SELECT current_user") == APP_ROLE
        await in_tenant(conn, "acme")
        assert [r["task_id"] for r in await conn.fetch("SELECT task_id FROM tasks")] == ["acme-task"]
        # Even naming the other tenant's row explicitly finds nothing, and cannot change it.
        assert await conn.fetchval("SELECT count(*) FROM tasks WHERE tenant_id = 'globex'") == 0
        assert await conn.execute("UPDATE tasks SET status_message = 'x' WHERE tenant_id = 'globex'") == "UPDATE 0"
        assert await conn.execute("DELETE FROM tasks WHERE tenant_id = 'globex'") == "DELETE 0"
        await conn.execute("ROLLBACK")
    finally:
        await conn.close()


async def test_the_app_role_cannot_write_rows_for_another_tenant(database_url: str) -> None:
    conn = await as_role(database_url, APP_ROLE)
    try:
        await in_tenant(conn, "acme")
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
            await conn.execute(INSERT_TASK, "globex", "smuggled")
        await conn.execute("ROLLBACK")
        await in_tenant(conn, "acme")
        await conn.execute(INSERT_TASK, "acme", "mine")
        # Moving a row to another tenant: refused (since migration 0005 by the column grants too).
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("UPDATE tasks SET tenant_id = 'globex' WHERE task_id = 'mine'")
        await conn.execute("ROLLBACK")
    finally:
        await conn.close()


async def test_no_tenant_set_means_no_rows(database_url: str, two_tenants: None) -> None:
    conn = await as_role(database_url, APP_ROLE)
    try:
        for table in ("tasks", "task_messages", "sessions"):
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0, table
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(INSERT_TASK, "acme", "no-tenant")
    finally:
        await conn.close()


async def test_the_app_role_cannot_turn_the_wall_off(database_url: str) -> None:
    conn = await as_role(database_url, APP_ROLE)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("ALTER TABLE tasks DISABLE ROW LEVEL SECURITY")
        row = await conn.fetchrow("SELECT rolbypassrls, rolsuper FROM pg_roles WHERE rolname = $1", APP_ROLE)
        assert (row["rolbypassrls"], row["rolsuper"]) == (False, False)
        owner = await conn.fetchval("SELECT tableowner FROM pg_tables WHERE tablename = 'tasks'")
        assert owner not in (APP_ROLE, RUNNER_ROLE)
    finally:
        await conn.close()


async def test_the_runner_role_sees_every_tenant(database_url: str, two_tenants: None) -> None:
    conn = await as_role(database_url, RUNNER_ROLE)
    try:
        assert await conn.fetchval("SELECT count(*) FROM tasks") == 2
    finally:
        await conn.close()


async def test_the_running_service_queries_as_the_app_role(server: RunningServer) -> None:
    core = server.app.state.core
    assert await core.db.fetchval("SELECT current_user") == APP_ROLE
    assert await core.runner_db.fetchval("SELECT current_user") == RUNNER_ROLE


async def test_a_login_role_that_only_inherits_the_roles_sees_no_rows(database_url: str, two_tenants: None) -> None:
    """The all-tenants policy also requires current_user to be the runner role: a pooler that drops the
    role startup parameter, or a session without it, sees nothing rather than everything. Every
    table with such a policy, as migration 0018 writes the condition (a null test of a CASE)."""
    name = f"mcp_tasks_login_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute(f"CREATE ROLE {name} LOGIN IN ROLE {APP_ROLE}, {RUNNER_ROLE}")
        member = await asyncpg.connect(database_url, user=name)
        try:
            assert await member.fetchval("SELECT current_user") == name
            tables = ("tasks", "active_tasks", "task_messages", "sessions", "event_payloads", "runners",
                      "audit_events", "audit_heads")  # fmt: skip
            for table in tables:
                assert await member.fetchval(f"SELECT count(*) FROM {table}") == 0, table
        finally:
            await member.close()
    finally:
        await admin.execute(f"DROP OWNED BY {name}")
        await admin.execute(f"DROP ROLE {name}")
        await admin.close()


@pytest.mark.parametrize(
    "tenant",
    ["o'brien", "back\\slash", "x', true); SELECT set_config('app.tenant_id', 'acme", "\\'; --", "ünï\u2028code"],
)
async def test_the_tenant_setting_is_exactly_the_callers_tenant_whatever_its_characters(
    database_url: str, two_tenants: None, tenant: str
) -> None:
    """BEGIN and the tenant setting share one round trip, the tenant as an escaped literal: quotes,
    backslashes and injection attempts arrive verbatim and see none of another tenant's rows."""
    db = Database(database_url, pool_size=1, role=APP_ROLE)
    await db.open()
    try:
        async with db.transaction(tenant) as conn:
            assert await conn.fetchval("SELECT current_setting('app.tenant_id')") == tenant
            assert await conn.fetchval("SELECT count(*) FROM tasks") == 0
            await conn.execute(INSERT_TASK, tenant, "mine")
        async with db.transaction(tenant) as conn:
            assert [r["tenant_id"] for r in await conn.fetch("SELECT tenant_id FROM tasks")] == [tenant]
        # The setting is transaction-local and the pool's reset is a no-op: nothing carries over.
        async with db.transaction() as conn:
            assert await conn.fetchval("SELECT current_setting('app.tenant_id', true)") in (None, "")
            assert await conn.fetchval("SELECT count(*) FROM tasks") == 0
    finally:
        await db.close()


async def test_a_tenant_with_a_nul_character_is_refused_before_any_sql(database_url: str) -> None:
    db = Database(database_url, pool_size=1, role=APP_ROLE)
    await db.open()
    try:
        with pytest.raises(InvalidArguments, match="NUL"):
            async with db.transaction("a\x00b"):
                pass
        async with db.transaction("acme") as conn:  # the pool is still healthy
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        await db.close()


async def test_a_failed_statement_rolls_back_and_the_connection_is_reused_cleanly(database_url: str) -> None:
    db = Database(database_url, pool_size=1, role=APP_ROLE)
    await db.open()
    try:

        async def insert_twice() -> None:
            async with db.transaction("acme") as conn:
                await conn.execute(INSERT_TASK, "acme", "dup")
                await conn.execute(INSERT_TASK, "acme", "dup")

        with pytest.raises(asyncpg.UniqueViolationError):
            await insert_twice()
        async with db.transaction("acme") as conn:
            assert await conn.fetchval("SELECT count(*) FROM tasks WHERE task_id = 'dup'") == 0
    finally:
        await db.close()
