"""The schema's SECURITY DEFINER functions against objects planted in schema public (SECURITY.md,
operator checklist).

Such a function looks names up in pg_catalog and then public, and PostgreSQL takes a function or
operator whose argument types match exactly over a built-in that needs a cast, whichever schema it
is in. A login that may create in public (every role, on PostgreSQL 14 unless revoked) could so
run its code as the function's owner. The migrations revoke CREATE on public where they may, the
service warns at start when its login still has it, and the maintenance functions call nothing
that a planted object could stand in for.
"""

from __future__ import annotations

import asyncio

import asyncpg

from service.store import migrate
from service.store.db import APP_ROLE, RUNNER_ROLE, Database
from tests.security.conftest import ClosedDatabase

# Closer matches than the built-ins the maintenance functions call (hashtextextended(text, bigint),
# format(text, VARIADIC "any"), oid = oid): each would run as the schema's owner.
PLANTED = [
    """CREATE FUNCTION public.hashtextextended(text, integer) RETURNS bigint LANGUAGE plpgsql AS
       $$ BEGIN RAISE EXCEPTION 'planted hashtextextended ran as %', current_user; END $$""",
    """CREATE FUNCTION public.format(text, text) RETURNS text LANGUAGE plpgsql AS
       $$ BEGIN RAISE EXCEPTION 'planted format ran as %', current_user; END $$""",
    """CREATE FUNCTION public.planted_eq(oid, regclass) RETURNS boolean LANGUAGE plpgsql AS
       $$ BEGIN RAISE EXCEPTION 'planted = ran as %', current_user; END $$""",
    "CREATE OPERATOR public.= (LEFTARG = oid, RIGHTARG = regclass, FUNCTION = public.planted_eq)",
]


async def test_the_migrations_take_create_on_public_from_everyone(closed_db: ClosedDatabase) -> None:
    """PostgreSQL 14's default (CREATE on public for PUBLIC), put back, then the migrations run
    again: it is taken away, and the service's login may not create there."""
    admin = await asyncpg.connect(closed_db.admin_url)
    try:
        await asyncio.to_thread(migrate.downgrade, closed_db.admin_url, "base")
        await admin.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        await asyncio.to_thread(migrate.upgrade, closed_db.admin_url)
        assert not await admin.fetchval("SELECT has_schema_privilege('public', 'public', 'CREATE')")
    finally:
        await admin.close()
    db = Database(closed_db.service_url, pool_size=1, role=APP_ROLE)
    await db.open()
    try:
        assert await db.login_may_create_in_public() is False
    finally:
        await db.close()


async def test_the_service_warns_when_its_login_may_create_in_public(closed_db: ClosedDatabase) -> None:
    admin = await asyncpg.connect(closed_db.admin_url)
    db = Database(closed_db.service_url, pool_size=1, role=APP_ROLE)
    await db.open()
    try:
        await admin.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        may = await db.login_may_create_in_public()
        assert may is True
        warned = db.configuration_warnings(autovacuum_on=True, login_may_create_in_public=may)
        assert len(warned) == 1
        assert "REVOKE CREATE ON SCHEMA public FROM PUBLIC" in warned[0]
        assert db.configuration_warnings(autovacuum_on=True, login_may_create_in_public=False) == []
    finally:
        await admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        await db.close()
        await admin.close()


async def test_objects_planted_in_public_do_not_run_inside_the_maintenance_functions(
    closed_db: ClosedDatabase,
) -> None:
    """The service's login, given CREATE on public as PostgreSQL 14 gives it, plants closer matches
    of what the analysis functions call; the runner role's calls of them do not run any (they
    would raise, as the schema's owner)."""
    admin = await asyncpg.connect(closed_db.admin_url)
    await admin.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
    service = await closed_db.connect_as(None)
    try:
        for statement in PLANTED:
            await service.execute(statement)
        # Enough rows changed that both functions reach every statement (their ANALYZE included).
        await admin.execute(
            "INSERT INTO sessions (tenant_id, session_id, subject, protocol_version, client_capabilities) "
            "SELECT 't', 's' || i, 'u', '2025-11-25', '{}' FROM generate_series(1, 60) i"
        )
        await admin.execute("SELECT pg_stat_force_next_flush()")
        await admin.execute("SELECT 1")  # the end of a transaction: the flush
        runner = await closed_db.connect_as(RUNNER_ROLE)
        try:
            young = {r["relname"]: r["analysed"] for r in await runner.fetch("SELECT * FROM analyze_young_tables()")}
            assert young["sessions"] is True
            await admin.execute(
                "INSERT INTO sessions (tenant_id, session_id, subject, protocol_version, client_capabilities) "
                "SELECT 't', 'x' || i, 'u', '2025-11-25', '{}' FROM generate_series(1, 60) i"
            )
            await admin.execute("SELECT pg_stat_force_next_flush()")
            await admin.execute("SELECT 1")
            assert "sessions" in await runner.fetchval("SELECT analyze_stale_tables('0')")
        finally:
            await runner.close()
    finally:
        await service.execute("DROP OPERATOR IF EXISTS public.= (oid, regclass)")
        for fn in ("hashtextextended(text, integer)", "format(text, text)", "planted_eq(oid, regclass)"):
            await service.execute(f"DROP FUNCTION IF EXISTS public.{fn}")
        await service.close()
        await admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        await admin.close()
