"""Run a multi-statement SQL script inside an Alembic revision.

asyncpg prepares every statement, and a prepared statement holds one command; the simple-query
protocol (``Connection.execute`` without arguments) runs a whole script in the migration's
transaction, so revisions stay readable SQL.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy.util import await_only


def run_script(sql: str) -> None:
    driver_conn = op.get_bind().connection.driver_connection
    assert driver_conn is not None
    await_only(driver_conn.execute(sql))
