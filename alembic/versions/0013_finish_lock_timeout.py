"""A batch of outcomes waits at most two seconds for a row lock.

Revision ID: 0013
Revises: 0012

``task_finish_batch`` ran on the runner's connections, which have no lock timeout: one task row
held by a transaction left open (an operator's psql, a stuck write elsewhere) held the batch that
wanted it, and with it every later outcome of the runner (one batch in flight at a time), for as
long as that transaction lasted. Now the function sets ``lock_timeout`` for its own run: past two
seconds the statement is refused and rolled back (SQLSTATE 55P03), the batcher answers its items
one by one, and only the outcome whose row is locked waits (retried by its runner with backoff).
Same signature, result and grants.
"""

from service.store.sqlscript import run_script

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("ALTER FUNCTION task_finish_batch(jsonb) SET lock_timeout = '2s';")


def downgrade() -> None:
    run_script("ALTER FUNCTION task_finish_batch(jsonb) RESET lock_timeout;")
