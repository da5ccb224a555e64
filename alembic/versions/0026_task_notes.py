"""A run's note to the run after a takeover (issue 41, point 4): task_notes, where an upstream MCP
server's task id is kept with ours, so that the runner that takes a task over follows the same
upstream task instead of calling the upstream again.

Revision ID: 0026
Revises: 0025

Append-only: once committed, this file never changes (docs/decisions.md). A changed SQL function
is created here with its full new body; alembic/schema.sql gets the same change.
"""

from service.store.sqlscript import run_script

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    -- ============================================================================== task notes ==
    -- A run's note to the run that may follow it after a takeover (a tool's ToolContext.remember):
    -- one small JSON object per task, written by the runner holding the task's lease (the write names
    -- owner and epoch), read when a run starts. An upstream MCP server's task id lives here, so that
    -- the next runner follows the same upstream task instead of calling again. A task with a note is
    -- handed back to the queue, not failed: its tool decides from the note (docs/decisions.md,
    -- "Upstream MCP servers"). Deleted with its task.
    CREATE TABLE task_notes (
        tenant_id  text        NOT NULL,
        task_id    text        NOT NULL,
        note       jsonb       NOT NULL,
        written_at timestamptz NOT NULL DEFAULT clock_timestamp(),
        CONSTRAINT task_notes_pkey PRIMARY KEY (tenant_id, task_id),
        CONSTRAINT task_notes_task_fkey FOREIGN KEY (tenant_id, task_id)
            REFERENCES tasks (tenant_id, task_id) ON DELETE CASCADE,
        CONSTRAINT task_notes_object CHECK (jsonb_typeof(note) = 'object'),
        CONSTRAINT task_notes_small CHECK (octet_length(note::text) <= 16384)
    );

    GRANT SELECT, INSERT, UPDATE, DELETE ON task_notes TO mcp_tasks_runner;
    GRANT SELECT, DELETE ON task_notes TO mcp_tasks_app, mcp_tasks_record;
    ALTER TABLE task_notes ENABLE ROW LEVEL SECURITY;
    ALTER TABLE task_notes FORCE ROW LEVEL SECURITY;
    CREATE POLICY task_notes_tenant_isolation ON task_notes TO mcp_tasks_app
        USING (tenant_id = current_setting('app.tenant_id', true));
    CREATE POLICY task_notes_runner_all_tenants ON task_notes TO mcp_tasks_runner
        USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');
    CREATE POLICY task_notes_record ON task_notes TO mcp_tasks_record
        USING (current_user = 'mcp_tasks_record');
    """)


def downgrade() -> None:
    run_script("""
    DROP TABLE task_notes;
    """)
