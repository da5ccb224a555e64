"""Migrations are raw SQL, reversible, and each runs in one transaction; release 0.1.0's baseline
is the first, and a database from before it is refused with a message, not migrated."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest
from alembic import command
from alembic.config import Config

from service.store import migrate
from tests.conftest import _with_db, http_client
from tests.pgdump import schema_dump


async def test_upgrade_downgrade_upgrade_round_trips(admin_dsn: str, database_url: str) -> None:
    """Down to base leaves what an empty database has; up again rebuilds the whole catalog, not only
    the columns: functions, triggers, policies and grants too."""
    at_head = schema_dump(database_url)
    assert await migrate.current_revision(database_url) == migrate.head_revision()
    await asyncio.to_thread(migrate.downgrade, database_url, "base")
    empty = f"mcp_tasks_empty_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{empty}"')
        assert schema_dump(database_url) == schema_dump(_with_db(admin_dsn, empty))
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{empty}" WITH (FORCE)')
        await admin.close()
    await asyncio.to_thread(migrate.upgrade, database_url)
    assert schema_dump(database_url) == at_head


async def test_schema_refuses_a_terminal_status_without_outcome(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        insert = """INSERT INTO tasks (tenant_id, task_id, subject, wire, tool, arguments, ttl_ms,
                    poll_interval_ms, expires_at, status) VALUES ('t', $1, 's', '2025-11-25', 'echo', '{}', 1000,
                    100, now(), $2)"""
        with pytest.raises(asyncpg.CheckViolationError) as caught:
            await conn.execute(insert, "a", "completed")
        assert caught.value.constraint_name == "tasks_outcome_matches_status"
    finally:
        await conn.close()


_REVISION = '''"""A test revision.

Revision ID: {rev}
Revises: {down}
"""

from service.store.sqlscript import run_script

revision = "{rev}"
down_revision = "{down}"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("CREATE TABLE probe_{rev} (id integer)")
    run_script("{then}")


def downgrade() -> None:
    run_script("DROP TABLE probe_{rev}")
'''


async def test_a_migration_that_fails_half_way_leaves_the_previous_revision(database_url: str, tmp_path: Path) -> None:
    """A revision after head applies; the next creates a table, then fails: it is rolled back whole, the first stays."""
    scripts = tmp_path / "alembic"
    shutil.copytree(migrate.script_location(), scripts, ignore=shutil.ignore_patterns("__pycache__"))
    head = migrate.head_revision()
    (scripts / "versions" / "9998_ok.py").write_text(_REVISION.format(rev="9998", down=head, then="SELECT 1"))
    (scripts / "versions" / "9999_fails.py").write_text(_REVISION.format(rev="9999", down="9998", then="SELECT 1/0"))
    cfg = Config()
    cfg.set_main_option("script_location", str(scripts))
    cfg.set_main_option("sqlalchemy.url", database_url)
    with pytest.raises(Exception, match="division by zero"):
        await asyncio.to_thread(command.upgrade, cfg, "head")
    assert await migrate.current_revision(database_url) == "9998"
    conn = await asyncpg.connect(database_url)
    try:
        tables = {
            r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE tablename LIKE 'probe%'")
        }
        assert tables == {"probe_9998"}
    finally:
        await conn.close()


def test_migrate_on_a_database_at_head_is_a_no_op_that_says_so(database_url: str) -> None:
    env = {**os.environ, "MCP_TASKS_DATABASE_URL": database_url}
    done = subprocess.run(
        [sys.executable, "-m", "service", "migrate"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"database already at head ({migrate.head_revision()}); nothing to do"
    assert "Running upgrade" not in done.stderr


async def test_a_newer_schema_keeps_this_version_ready_an_older_one_does_not(database_url: str) -> None:
    """Rolling upgrades: the new release migrates first; old replicas stay ready on the newer schema
    (migrations only add while two releases run, CONTRIBUTING.md). An older schema is not enough."""

    from tests.conftest import make_settings, serve

    conn = await asyncpg.connect(database_url)
    try:
        async with serve(make_settings(database_url)) as running, http_client() as http:
            readyz = running.url.removesuffix("/mcp") + "/readyz"
            assert (await http.get(readyz)).status_code == 200
            await conn.execute("UPDATE alembic_version SET version_num = '9999_from_a_newer_release'")
            ready = await http.get(readyz)
            assert ready.status_code == 200
            assert ready.json()["revision"] == "9999_from_a_newer_release"
            await conn.execute("UPDATE alembic_version SET version_num = '0001'")
            if migrate.head_revision() != "0001":
                assert (await http.get(readyz)).status_code == 503
    finally:
        await conn.close()


async def test_a_database_from_before_the_baseline_is_refused_with_what_to_do(database_url: str) -> None:
    """A development build's database at a squashed revision (0001-0020) is neither run on nor
    "migrated" into a broken state: start-up and `mcp-tasks migrate` say to recreate it."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("UPDATE alembic_version SET version_num = '0020'")
        assert not migrate.schema_fits("0020")
        with pytest.raises(RuntimeError, match="recreate"):
            await asyncio.to_thread(migrate.upgrade_to_head, database_url)
        done = subprocess.run(
            [sys.executable, "-m", "service", "migrate"],
            env={**os.environ, "MCP_TASKS_DATABASE_URL": database_url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1
        assert "recreate the database" in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        await conn.execute("UPDATE alembic_version SET version_num = $1", migrate.head_revision())
        await conn.close()
