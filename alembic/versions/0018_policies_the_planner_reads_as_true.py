"""The runner role's all-tenants policies written so that the planner sees them hold for every row.

Revision ID: 0018
Revises: 0017

Every policy that gives the runner role the rows of all tenants also requires ``current_user`` to
be that role, so that a login user who merely inherits it sees nothing. As ``current_user =
'mcp_tasks_runner'`` that condition names no column, and the planner estimates any such comparison
to hold for 0.5 % of the rows (``eqsel``'s default): every scan of the runner role was planned for
1/200 of the rows it returns. With 100,000 tasks queued, the claim's window, estimated at 136 rows,
was a scan of the table and an on-disk sort of all of them (60 ms per claim) rather than the
queue's index read in order until the window is full.

The same condition is now written ``(CASE WHEN current_user = 'mcp_tasks_runner' THEN true END)
IS NOT NULL``: true for that role and false for any other, as before, and a null test of an
expression, which the planner estimates to hold for 99.5 % of rows. The claim with 100,000
queued: 3 ms. ``WITH CHECK`` clauses play no part in estimates and are unchanged.

The record role's policies keep the plain comparison: its statements, inside the record's
functions, find rows by key, and written this way they cost a create 8-11 % more PostgreSQL CPU in
two runs of ``bench/ab.py --workload create`` (plans chosen for 200 times the rows).

``ALTER POLICY`` rewrites nothing, but takes each table's ACCESS EXCLUSIVE lock and holds it until
the revision commits, so a wait for a later table holds up every request to the earlier ones. The
revision waits at most 2 s for each lock: a long transaction on one of the tables fails it, having
changed nothing (run it again), rather than queue the service's requests behind it.
"""

from service.store.sqlscript import run_script

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

UPGRADE = """
SET LOCAL lock_timeout = '2s';
ALTER POLICY tasks_runner_all_tenants ON tasks USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL);
ALTER POLICY active_tasks_runner_all_tenants ON active_tasks USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL);
ALTER POLICY task_messages_runner_all_tenants ON task_messages USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL);
ALTER POLICY sessions_runner_all_tenants ON sessions USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL);
ALTER POLICY event_payloads_runner_all_tenants ON event_payloads USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL);
ALTER POLICY runners_runner_only ON runners USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL);
ALTER POLICY audit_events_runner_all_tenants ON audit_events USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL);
ALTER POLICY audit_heads_runner_all_tenants ON audit_heads USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL);
"""

DOWNGRADE = """
SET LOCAL lock_timeout = '2s';
ALTER POLICY tasks_runner_all_tenants ON tasks USING (current_user = 'mcp_tasks_runner');
ALTER POLICY active_tasks_runner_all_tenants ON active_tasks USING (current_user = 'mcp_tasks_runner');
ALTER POLICY task_messages_runner_all_tenants ON task_messages USING (current_user = 'mcp_tasks_runner');
ALTER POLICY sessions_runner_all_tenants ON sessions USING (current_user = 'mcp_tasks_runner');
ALTER POLICY event_payloads_runner_all_tenants ON event_payloads USING (current_user = 'mcp_tasks_runner');
ALTER POLICY runners_runner_only ON runners USING (current_user = 'mcp_tasks_runner');
ALTER POLICY audit_events_runner_all_tenants ON audit_events USING (current_user = 'mcp_tasks_runner');
ALTER POLICY audit_heads_runner_all_tenants ON audit_heads USING (current_user = 'mcp_tasks_runner');
"""


def upgrade() -> None:
    run_script(UPGRADE)


def downgrade() -> None:
    run_script(DOWNGRADE)
