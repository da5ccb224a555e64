"""Two indexes fewer to keep on every task create and every audit event.

Revision ID: 0015
Revises: 0014

- ``tasks_active_owner`` (tenant, subject) of the active tasks served the caps until migration 0004
  gave them counters; since then only the queue gauges' scan of active rows (``queue_by_tool``,
  once per maintenance pass) read it, and a statement without statistics could mistake it for the
  way to one task (migration 0012). Every create inserted an entry into it. The gauges now read the
  rows of ``tasks_claimable`` and ``tasks_leased`` (the queued and the leased tasks, what they count).
- ``audit_events_time`` (tenant, at), a B-tree entry for every audit event (three per task
  lifecycle), served only an export from a time on. Times grow with each chain (never before the
  event they follow), so a block range index on ``at`` finds those rows as well, for an insert cost
  next to nothing.

Measured with ``bench/sql_cpu.py`` (issue 15). A server of the release before reads the gauges
without the partial index it used: one scan of ``tasks`` per maintenance pass, until it is replaced.
"""

from service.store.sqlscript import run_script

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

UPGRADE = """
DROP INDEX tasks_active_owner;
DROP INDEX audit_events_time;
CREATE INDEX audit_events_at ON audit_events USING brin (at);
"""

DOWNGRADE = """
DROP INDEX audit_events_at;
CREATE INDEX audit_events_time ON audit_events (tenant_id, at);
CREATE INDEX tasks_active_owner ON tasks (tenant_id, subject) WHERE task_status_active(status);
"""


def upgrade() -> None:
    run_script(UPGRADE)


def downgrade() -> None:
    run_script(DOWNGRADE)
