"""Run a multi-statement SQL script inside an Alembic revision, in the revision's transaction.

asyncpg prepares every statement, and a prepared statement holds one command; the simple-query
protocol (``Connection.execute`` without arguments) runs a whole script at once, so revisions stay
readable SQL.
"""

from __future__ import annotations

from typing import Any

from alembic import op
from sqlalchemy.util import await_only


def _driver() -> Any:
    """The revision's asyncpg connection, under SQLAlchemy's adapter."""
    driver_conn = op.get_bind().connection.driver_connection
    assert driver_conn is not None
    return driver_conn


def run_script(sql: str) -> None:
    bind = op.get_bind()
    driver_conn = _driver()
    # SQLAlchemy's asyncpg adapter sends BEGIN only before its own first statement. A script sent
    # straight to the driver before that would run in autocommit, outside the revision's
    # transaction: a revision failing half-way would leave its first half behind.
    if not driver_conn.is_in_transaction():
        bind.exec_driver_sql("SELECT 1")
    assert driver_conn.is_in_transaction(), "a migration script must run inside the revision's transaction"
    await_only(driver_conn.execute(sql))
