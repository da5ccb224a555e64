"""The planner's statistics when the server's autovacuum is off (migration 0012, docs/decisions.md
"Statistics when autovacuum is off"): the maintenance pass analyses the service's tables that
changed enough, as autovacuum would, and nothing when autovacuum is on."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest

from service.runtime.maintenance import Maintenance
from service.store.db import APP_ROLE, RUNNER_ROLE, Database
from service.store.repository import RunnerStore
from service.tools.registry import Registry
from tests.test_batch_record import create, ordered


@pytest.fixture
async def runner_db(database_url: str) -> AsyncIterator[Database]:
    db = Database(database_url, pool_size=2, role=RUNNER_ROLE)
    await db.open()
    try:
        yield db
    finally:
        await db.close()


async def created(database_url: str, n: int) -> None:
    """``n`` tasks of one tenant, written as the service writes them, with the writer's table
    statistics flushed at once (a backend sends them at most every second otherwise)."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"SET ROLE {APP_ROLE}")
        items = ordered([create("busy", "alice", max_per_requestor=10**6, max_per_tenant=10**6) for _ in range(n)])
        await conn.fetch("SELECT task_id FROM task_batch($1::jsonb)", json.dumps(items))
        await conn.execute("SELECT pg_stat_force_next_flush()")
        await conn.execute("SELECT 1")  # the end of a transaction: the flush
    finally:
        await conn.close()


async def tasks_analysed(database_url: str) -> bool:
    conn = await asyncpg.connect(database_url)
    try:
        return bool(await conn.fetchval("SELECT reltuples >= 0 FROM pg_class WHERE relname = 'tasks'"))
    finally:
        await conn.close()


async def test_a_table_is_analysed_once_it_changed_as_much_as_autovacuum_waits_for(
    database_url: str, runner_db: Database
) -> None:
    """Autovacuum's default threshold: 50 rows, then 10 % of the table more; and at most once per
    interval (the maintenance pass: a minute), however much changed."""
    store = RunnerStore(runner_db)
    at_once = timedelta(0)
    await created(database_url, 40)
    assert "tasks" not in await store.analyze_stale(at_once)
    assert not await tasks_analysed(database_url)
    await created(database_url, 20)  # 60 changed: over 50
    assert "tasks" in await store.analyze_stale(at_once)
    assert await tasks_analysed(database_url)
    assert "tasks" not in await store.analyze_stale(at_once)  # nothing changed since
    await created(database_url, 55)  # 50 + 10 % of 60 is 56
    assert "tasks" not in await store.analyze_stale(at_once)
    await created(database_url, 2)
    assert "tasks" not in await store.analyze_stale()  # changed enough, but analysed within the minute
    assert "tasks" in await store.analyze_stale(at_once)


async def test_only_the_runner_role_may_ask_for_analyses(database_url: str) -> None:
    """What it may ask is fixed (the service's tables, when due); the request role may not ask."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"SET ROLE {APP_ROLE}")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.fetchval("SELECT analyze_stale_tables('0')")
    finally:
        await conn.close()


@pytest.mark.parametrize("autovacuum_off", [True, False])
async def test_the_maintenance_pass_analyses_only_when_autovacuum_is_off(
    database_url: str, runner_db: Database, autovacuum_off: bool
) -> None:
    await created(database_url, 120)
    maintenance = Maintenance(
        runner_db, Registry.load(["service.tools.demo"]), interval_s=60, session_idle_ms=60_000,
        analyze=autovacuum_off,
    )  # fmt: skip
    await maintenance.run_once()
    assert await tasks_analysed(database_url) is autovacuum_off
