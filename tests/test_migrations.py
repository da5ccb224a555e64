"""Migrations are raw SQL, reversible: upgrade → downgrade → upgrade leaves the same schema."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from service.store import migrate
from service.store.queries import Q

SCHEMA_QUERY = """
SELECT table_name, column_name, data_type, is_nullable
FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 2
"""


async def test_upgrade_downgrade_upgrade_round_trips(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        at_head = await conn.fetch(SCHEMA_QUERY)
        assert await migrate.current_revision(database_url) == migrate.head_revision()
        await asyncio.to_thread(migrate.downgrade, database_url, "base")
        tables = await conn.fetchval(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'"
        )
        assert tables == 0
        await asyncio.to_thread(migrate.upgrade, database_url)
        assert await conn.fetch(SCHEMA_QUERY) == at_head
    finally:
        await conn.close()


async def test_schema_refuses_a_terminal_status_without_outcome(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        insert = """INSERT INTO tasks (tenant_id, task_id, subject, surface, tool, arguments, ttl_ms,
                    poll_interval_ms, expires_at, status) VALUES ('t', $1, 's', '2025-11-25', 'echo', '{}', 1000,
                    100, now(), $2)"""
        with pytest.raises(asyncpg.CheckViolationError) as caught:
            await conn.execute(insert, "a", "completed")
        assert caught.value.constraint_name == "tasks_outcome_matches_status"
    finally:
        await conn.close()


async def test_0004_counts_existing_active_tasks_and_keeps_audit_chains_verifiable(database_url: str) -> None:
    """Upgrading a database with tasks and audit events: the counters start at the true counts, and
    chains written by 0003's functions verify after 0004 replaced them (same canonical text)."""
    await asyncio.to_thread(migrate.downgrade, database_url, "0003")
    conn = await asyncpg.connect(database_url)
    try:
        insert = """INSERT INTO tasks (tenant_id, task_id, subject, surface, tool, arguments, ttl_ms,
                    poll_interval_ms, expires_at, status, outcome, payload)
                    VALUES ($1, $2, $3, '2025-11-25', 'echo', '{}', 60000, 100, now() + interval '1 minute', $4,
                    $5, $6)"""
        for i, (tenant, subject, status) in enumerate(
            [("a", "x", "working"), ("a", "x", "input_required"), ("a", "y", "working"), ("a", "y", "completed"),
             ("b", "x", "cancelled"), ("b", "z", "working")]
        ):  # fmt: skip
            done = status == "completed"
            await conn.execute(
                insert, tenant, f"t{i}", subject, status, "result" if done else None, "{}" if done else None
            )
        for tenant in ("a", "b"):
            await conn.execute("SELECT audit_append($1, 'deny', 'old', 's', 'c', 'i', NULL, NULL, NULL, NULL)", tenant)
        await asyncio.to_thread(migrate.upgrade, database_url)
        counts = {(r["tenant_id"], r["subject"]): r["active"] for r in await conn.fetch("SELECT * FROM active_tasks")}
        assert counts == {("a", "x"): 2, ("a", "y"): 1, ("b", "z"): 1}
        await conn.execute("SELECT audit_append('a', 'deny', 'new', 's', 'c', 'i', NULL, NULL, NULL, '{\"k\": 1}')")
        problems = await conn.fetch(Q["audit_chain_problems"], None)
        assert [dict(p) for p in problems] == []
        assert await conn.fetchval("SELECT seq FROM audit_heads WHERE tenant_id = 'a'") == 2
    finally:
        await conn.close()
