"""The queued tasks' index, described so that the runner role's planner knows how few they are.

Revision ID: 0017
Revises: 0016

The claim, the queue gauges and the pass that tells queued tasks no runner has their tool read the
queued tasks through the partial index ``tasks_claimable`` (``status = 'working' AND lease_owner IS
NULL``). Row-level security applies to the runner role, and under it the planner may not use a
column's statistics with an operator that is not leakproof (``selfuncs.c``,
``statistic_proc_security_check``): the enum's ``=`` is not, so ``status = 'working'`` was estimated
from the column's count of distinct values alone (``var_eq_const``'s fallback, without the most
common values), and in a table of finished tasks the queue looked like half the table, or all of it.
With 1 million finished tasks stored and 6,400 queued, the planner judged the index dearer than a
parallel scan of the table: 160 ms per claim, 220 ms per queue-gauge read and 200-780 ms per runner
check, every maintenance pass (5 s) on the database's core, and more as the table grows.
(``bench/run.py``'s scale run: the ``tasks/get`` p99 with 1 million tasks stored.)

``tasks_queued`` holds the same rows, named by null tests alone: ``lease_owner IS NULL AND
finished_at IS NULL`` (a task asks for input only while a runner holds it, every hand-back makes it
working again, and only the moves to a terminal status set ``finished_at``). A null test calls no
operator, so its statistics (the shares of unclaimed and of unfinished tasks) are open to every
role: the planner estimates the queue from them, whether it is a few rows among a million finished
(an index scan, not a scan of the table) or most of the table (the index's order, so the claim's
``LIMIT`` stops early, not a sort of it all: once migration 0018 has the runner's policy estimated
right too). The claim's window names these conditions and checks the status on the rows it
picked; the gauges count ``working`` among them.

Built ``CONCURRENTLY``: a plain ``CREATE INDEX`` holds writes to ``tasks`` for as long as the build
reads the table (0.4 s per million tasks stored, measured here). A build that failed leaves an
invalid index, dropped and built again by the next run of this revision. ``tasks_claimable`` stays
for now: the release before reads the queue through it while it runs beside this one, and again
after a rollback (CONTRIBUTING.md, "expand, then contract"); a later release drops it. Until then
a queued create enters both indexes.
"""

from service.store.sqlscript import run_outside_transaction

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_outside_transaction(
        "DROP INDEX CONCURRENTLY IF EXISTS tasks_queued",
        "CREATE INDEX CONCURRENTLY tasks_queued ON tasks (created_at)"
        " WHERE lease_owner IS NULL AND finished_at IS NULL",
    )


def downgrade() -> None:
    run_outside_transaction("DROP INDEX CONCURRENTLY IF EXISTS tasks_queued")
