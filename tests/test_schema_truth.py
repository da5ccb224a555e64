"""alembic/schema.sql is the schema: the migrations, run on an empty database, produce exactly it."""

from __future__ import annotations

import secrets

import asyncpg
import pytest

from service.store import migrate
from tests.conftest import _with_db
from tests.pgdump import object_diff, schema_dump, schema_objects

WHAT_TO_DO = """\
alembic/schema.sql and the migrations in alembic/versions/ describe different schemas.
  - lines: what the migrations build (upgraded to head);  + lines: what alembic/schema.sql builds.
To change the schema, edit alembic/schema.sql AND add a migration that makes the same change
(`alembic revision --rev-id <next> -m "..."`; a changed function carries its full new body).
Never edit a committed migration. See CONTRIBUTING.md."""


async def test_migrations_build_exactly_the_schema_file(admin_dsn: str, template_db: str) -> None:
    """template_db is an empty database upgraded to head; the other is schema.sql run alone."""
    name = f"mcp_tasks_truth_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        conn = await asyncpg.connect(_with_db(admin_dsn, name))
        try:
            await conn.execute((migrate.script_location() / "schema.sql").read_text())
        finally:
            await conn.close()
        migrated = schema_objects(_with_db(admin_dsn, template_db))
        from_file = schema_objects(_with_db(admin_dsn, name))
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    if migrated != from_file:
        diff = object_diff(migrated, from_file, "migrations", "schema.sql")
        pytest.fail(f"{WHAT_TO_DO}\n\n{diff}", pytrace=False)


def test_the_comparison_covers_function_bodies_policies_and_grants(admin_dsn: str, template_db: str) -> None:
    """A guard on the comparison itself: normalising must not drop what it is there to compare."""
    dump = schema_dump(_with_db(admin_dsn, template_db))
    for fragment in (
        "CREATE FUNCTION public.task_create(p_items jsonb) RETURNS SETOF public.tasks",
        "PERFORM pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || lock_tenant, 0));",
        "CREATE POLICY tasks_tenant_isolation ON public.tasks TO mcp_tasks_app",
        "ALTER TABLE ONLY public.tasks FORCE ROW LEVEL SECURITY;",
        "GRANT ALL ON FUNCTION public.task_finish(p_items jsonb) TO mcp_tasks_runner;",
        "CREATE TRIGGER tasks_count_deleted AFTER DELETE ON public.tasks",
    ):
        assert fragment in dump
    assert "alembic_version" not in dump
