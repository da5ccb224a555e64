"""Run Alembic migrations programmatically (``mcp-tasks migrate`` and start-up of the embedded DB)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import asyncpg
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory


@cache
def script_location() -> Path:
    """The migration scripts: inside the installed package, else the checkout's top-level alembic/.

    A wheel carries the repository's alembic/ as ``service/_alembic`` (pyproject.toml maps it);
    an editable install or a plain checkout reads alembic/ next to ``service/``."""
    shipped = resources.files("service").joinpath("_alembic")
    if shipped.joinpath("env.py").is_file():
        return Path(str(shipped))
    checkout = Path(__file__).resolve().parents[2] / "alembic"
    if (checkout / "env.py").is_file():
        return checkout
    raise RuntimeError(f"migration scripts not found (neither {shipped} nor {checkout})")


def _config(dsn: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    cfg.set_main_option("sqlalchemy.url", dsn.replace("%", "%%"))
    return cfg


@dataclass(frozen=True)
class Upgrade:
    """What ``upgrade_to_head`` did: the revision found, and the head it left the database at."""

    before: str | None
    head: str

    @property
    def changed(self) -> bool:
        return self.before != self.head


def upgrade(dsn: str, revision: str = "head") -> None:
    """Each revision runs in its own transaction: one that fails leaves the database at the one before."""
    command.upgrade(_config(dsn), revision)


def upgrade_to_head(dsn: str) -> Upgrade:
    before = asyncio.run(current_revision(dsn))
    head = head_revision()
    if before is not None and before_baseline(before):
        raise RuntimeError(
            f"the database is at revision {before}, made by a development build before release 0.1.0, whose "
            "migrations were squashed into one baseline: recreate the database (nothing was released before 0.1.0)"
        )
    if before != head:
        upgrade(dsn)
    return Upgrade(before, head)


def downgrade(dsn: str, revision: str) -> None:
    command.downgrade(_config(dsn), revision)


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config("postgresql://unused")).get_current_head()
    assert head is not None
    return head


def known_revisions() -> frozenset[str]:
    return frozenset(r.revision for r in ScriptDirectory.from_config(_config("postgresql://unused")).walk_revisions())


def before_baseline(current: str) -> bool:
    """A revision this version does not know that sorts before its first (revision ids are
    zero-padded numbers): a development build's from before the release 0.1.0 baseline."""
    first = min(known_revisions())
    return current not in known_revisions() and current < first


def schema_fits(current: str | None) -> bool:
    """Can this version run on a database at ``current``? At head, yes; at an older revision, no
    (run the migrations); at a revision this version does not know, yes if it is a newer release's
    (migrations only add while two releases run side by side, CONTRIBUTING.md, so a rolling upgrade
    keeps the old replicas ready after the new release migrated), no if it is from before the
    baseline."""
    if current is None:
        return False
    if current == head_revision():
        return True
    return current not in known_revisions() and not before_baseline(current)


async def current_revision(dsn: str) -> str | None:
    conn = await asyncpg.connect(dsn)
    try:
        exists = await conn.fetchval("SELECT to_regclass('alembic_version') IS NOT NULL")
        if not exists:
            return None
        rev: str | None = await conn.fetchval("SELECT version_num FROM alembic_version")
        return rev
    finally:
        await conn.close()


async def upgrade_async(dsn: str) -> None:
    """Alembic's env.py runs its own event loop, so migrate in a worker thread."""
    await asyncio.to_thread(upgrade_to_head, dsn)
