"""The planner's statistics (docs/decisions.md, "Statistics when autovacuum is off"): a new
deployment's tables get their first statistics once more than 50 rows changed, whatever autovacuum
does (migration 0016); after that, the maintenance pass analyses the tables that changed enough, as
autovacuum would, only when the server's autovacuum is off (migration 0012)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest

from service.runtime.maintenance import Maintenance
from service.store.db import APP_ROLE, RUNNER_ROLE, Database
from service.store.queries import Q
from service.store.runners import RunnerStore
from service.tools.registry import Registry
from tests.security.conftest import owned_by_a_non_superuser
from tests.test_batch_record import create, ordered

SERVICE_TABLES = ("active_tasks", "audit_events", "audit_heads", "audit_retrievals", "event_payloads", "runners",
                  "sessions", "task_messages", "tasks")  # fmt: skip


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
        await conn.fetch("SELECT task_id FROM task_create($1::jsonb)", json.dumps(items))
        await conn.execute("SELECT pg_stat_force_next_flush()")
        await conn.execute("SELECT 1")  # the end of a transaction: the flush
    finally:
        await conn.close()


async def tasks_counted(database_url: str) -> float:
    """The rows of tasks as its statistics count them."""
    conn = await asyncpg.connect(database_url)
    try:
        return float(await conn.fetchval("SELECT reltuples FROM pg_class WHERE relname = 'tasks'"))
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


async def test_a_young_table_gets_its_first_statistics_once_more_than_50_rows_changed(
    database_url: str, runner_db: Database
) -> None:
    """Migration 0016: every service table never analysed is reported, with whether the call
    analysed it and its rows changed; it is analysed past autovacuum's base threshold (more than 50
    changed rows), and once analysed it is no longer reported."""
    store = RunnerStore(runner_db)
    young = await store.analyze_young()
    assert young == dict.fromkeys(SERVICE_TABLES, (False, 0))
    await created(database_url, 50)
    assert (await store.analyze_young())["tasks"] == (False, 50)
    assert not await tasks_analysed(database_url)
    await created(database_url, 1)
    assert (await store.analyze_young())["tasks"] == (True, 51)
    assert await tasks_analysed(database_url)
    assert "tasks" not in await store.analyze_young()


async def test_a_young_table_is_left_to_the_process_that_is_analysing(database_url: str, runner_db: Database) -> None:
    """One process at a time: while another holds the analysis lock, a due table is reported young
    and not analysed, so the caller asks again."""
    await created(database_url, 60)
    holder = await asyncpg.connect(database_url)
    try:
        async with holder.transaction():
            await holder.execute("SELECT pg_advisory_xact_lock(hashtextextended('mcp_tasks:analyze', 0))")
            assert (await RunnerStore(runner_db).analyze_young())["tasks"] == (False, 60)
            assert not await tasks_analysed(database_url)
    finally:
        await holder.close()
    assert (await RunnerStore(runner_db).analyze_young())["tasks"] == (True, 60)


async def test_a_schema_owner_that_is_not_a_superuser_sees_which_tables_were_analysed(admin_dsn: str) -> None:
    """docs/operations.md: the schema's owner is not a superuser, and row-level security (forced on
    the owner too) hides its tables' statistics from it in pg_stats. Once analysed, a table is no
    longer young (else every start would analyse it again, and a process would poll for ever)."""
    async with owned_by_a_non_superuser(admin_dsn) as (url, _owner_url, owner):
        await created(url, 60)
        conn = await asyncpg.connect(url)
        try:
            tasks_owner = await conn.fetchval("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE relname = 'tasks'")
            await conn.execute(f"SET ROLE {RUNNER_ROLE}")
            first = {r["relname"]: r["analysed"] for r in await conn.fetch(Q["analyze_young_tables"])}
            again = {r["relname"] for r in await conn.fetch(Q["analyze_young_tables"])}
        finally:
            await conn.close()
        assert tasks_owner == owner
        assert first["tasks"] is True
        assert "tasks" not in again
        assert "audit_events" not in again  # 60 events: analysed with the tasks
        assert "task_messages" in again  # no rows yet: still young


async def test_only_the_runner_role_may_ask_for_analyses(database_url: str) -> None:
    """What it may ask is fixed (the service's tables, when due); the request role may not ask."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"SET ROLE {APP_ROLE}")
        for call in ("SELECT analyze_stale_tables('0')", "SELECT * FROM analyze_young_tables()"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.fetch(call)
    finally:
        await conn.close()


async def test_the_maintenance_pass_gives_young_tables_statistics_when_autovacuum_is_on(
    database_url: str, runner_db: Database
) -> None:
    """With autovacuum on the pass leaves analyses to it, but not a new deployment's first one."""
    await created(database_url, 120)
    maintenance = Maintenance(
        runner_db, Registry.load(["service.tools.demo"]), interval_s=60, session_idle_ms=60_000, analyze=False
    )
    await maintenance.run_once()
    assert await tasks_analysed(database_url)
    assert maintenance._young is False


@pytest.mark.parametrize("autovacuum_off", [True, False])
async def test_the_maintenance_pass_analyses_tables_with_statistics_only_when_autovacuum_is_off(
    database_url: str, runner_db: Database, autovacuum_off: bool
) -> None:
    """A table that was analysed and changed since is autovacuum's, unless autovacuum is off."""
    await created(database_url, 1)
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute("ANALYZE tasks")
    finally:
        await admin.close()
    await created(database_url, 120)
    maintenance = Maintenance(
        runner_db, Registry.load(["service.tools.demo"]), interval_s=60, session_idle_ms=60_000,
        analyze=autovacuum_off,
    )  # fmt: skip
    # Its last analysis a minute ago as far as the pass is concerned (the pass waits a minute).
    maintenance.store.analyze_stale = functools.partial(maintenance.store.analyze_stale, timedelta(0))  # type: ignore[method-assign]
    await maintenance.run_once()
    admin = await asyncpg.connect(database_url)
    try:
        reltuples = await admin.fetchval("SELECT reltuples FROM pg_class WHERE relname = 'tasks'")
    finally:
        await admin.close()
    assert (reltuples == 121) is autovacuum_off


@pytest.mark.parametrize("idle_s", [0.5, 6.0])
async def test_between_passes_young_tables_are_analysed_within_seconds(
    database_url: str, runner_db: Database, idle_s: float
) -> None:
    """A pass every 5 s, yet the new deployment's tasks get statistics within about a second of
    their first 50 changes (their counts sent at once here; the pass looks at most a second apart
    while idle, every 0.25 s while rows change), also after standing idle past a pass; and then
    the maintenance stops looking. The statistics count the 60 rows: they were taken after the
    creates, not of the empty table by a pass before them."""
    maintenance = Maintenance(runner_db, Registry.load(["service.tools.demo"]), interval_s=5, session_idle_ms=60_000)
    await maintenance.start()
    try:
        await asyncio.sleep(idle_s)  # standing idle: the first pass, on empty tables (and, for 6 s, the second)
        assert not await tasks_analysed(database_url)
        await created(database_url, 60)
        for _ in range(30):  # the next pass could be up to 5 s away
            if await tasks_analysed(database_url):
                break
            await asyncio.sleep(0.1)
        assert await tasks_analysed(database_url)
        assert await tasks_counted(database_url) == 60
        async with asyncio.timeout(5):  # the look that analysed them has returned
            while maintenance._young:
                await asyncio.sleep(0.01)
    finally:
        await maintenance.stop()


async def test_an_idle_young_deployment_is_looked_at_less_and_less_often(runner_db: Database) -> None:
    """No rows change: each look doubles the wait (0.25 s, 0.5, then every second), where looking
    every 0.25 s would have looked about 16 times in 4 seconds. Timed between the looks
    themselves: the first five, the first in the pass at start."""
    maintenance = Maintenance(runner_db, Registry.load(["service.tools.demo"]), interval_s=60, session_idle_ms=60_000)
    looks: list[float] = []
    fifth = asyncio.Event()
    look = maintenance.store.analyze_young

    async def counted() -> dict[str, tuple[bool, int]]:
        looks.append(time.monotonic())
        if len(looks) == 5:
            fifth.set()
        return await look()

    maintenance.store.analyze_young = counted  # type: ignore[method-assign]
    await maintenance.start()
    try:
        async with asyncio.timeout(15):  # 0.5 + 1 + 1 + 1 s of waits
            await fifth.wait()
    finally:
        await maintenance.stop()
    gaps = [b - a for a, b in itertools.pairwise(looks[:5])]
    assert gaps[0] >= 0.25 - 0.01, gaps
    assert all(gap >= 1.0 - 0.01 for gap in gaps[2:]), gaps  # every second: no longer every 0.25 s
    assert maintenance._young is True


async def test_stopping_lets_the_look_in_flight_finish(runner_db: Database) -> None:
    """A statement cut by a cancellation makes asyncpg send PostgreSQL a cancel request over a
    connection of its own, which the end of the process may leave behind: stop lets the look in
    flight end, and the loop ends at its next wait."""
    maintenance = Maintenance(runner_db, Registry.load(["service.tools.demo"]), interval_s=60, session_idle_ms=60_000)
    look = maintenance.store.analyze_young
    ended: list[bool] = []
    started = asyncio.Event()

    async def slow() -> dict[str, tuple[bool, int]]:
        if maintenance._task is not None and started.is_set():
            return await look()
        started.set()
        try:
            await asyncio.sleep(0.3)  # a statement in flight, as far as the loop can tell
            ended.append(True)
        except asyncio.CancelledError:
            ended.append(False)
            raise
        return await look()

    maintenance.store.analyze_young = slow  # type: ignore[method-assign]
    await maintenance.start()
    await started.wait()
    await maintenance.stop()
    assert ended == [True]
    assert maintenance._task is not None
    assert maintenance._task.done()
