"""Migrations are raw SQL, reversible: upgrade → downgrade → upgrade leaves the same schema."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from service.store import migrate

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
