"""Alembic environment: raw-SQL revisions run over SQLAlchemy's asyncpg dialect."""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine


def _async_url(url: str) -> str:
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    return url


def _run(connection: Connection) -> None:
    context.configure(connection=connection, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    url = context.config.get_main_option("sqlalchemy.url") or os.environ.get("MCP_TASKS_DATABASE_URL")
    if not url:
        raise SystemExit("no database URL: set MCP_TASKS_DATABASE_URL")
    engine = create_async_engine(_async_url(url))
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:  # a revision that fails still closes the pool's connection (else it is left to the GC)
        await engine.dispose()


asyncio.run(_main())
