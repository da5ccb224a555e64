"""What each process sees of its upstream MCP servers (issue 41), for `mcp-tasks upstreams`: a row
per process and upstream, written by the process (the runner role) while it lives.

Revision ID: 0025
Revises: 0024

Append-only: once committed, this file never changes (docs/decisions.md). A changed SQL function
is created here with its full new body; alembic/schema.sql gets the same change.
"""

from service.store.sqlscript import run_script

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    -- ================================================================================= upstreams ==
    -- Each process follows its upstreams itself (MCP_TASKS_UPSTREAMS_FILE) and says here what it sees:
    -- {transport, state, down_since, circuit, tools, last_error}, on every change and every few
    -- seconds, its word holding until live_until; a process that stops takes its rows back, and rows
    -- long past their word are deleted by the next write. `mcp-tasks upstreams` reads the live ones.
    -- Nothing here is a tenant's: only the runner role (and the record role, to read) may see it.
    CREATE TABLE upstream_states (
        owner      text        NOT NULL,
        upstream   text        NOT NULL,
        state      jsonb       NOT NULL,
        seen_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
        live_until timestamptz NOT NULL,
        CONSTRAINT upstream_states_pkey PRIMARY KEY (owner, upstream),
        CONSTRAINT upstream_states_state_object CHECK (jsonb_typeof(state) = 'object')
    );

    GRANT SELECT, INSERT, UPDATE, DELETE ON upstream_states TO mcp_tasks_runner;
    ALTER TABLE upstream_states ENABLE ROW LEVEL SECURITY;
    ALTER TABLE upstream_states FORCE ROW LEVEL SECURITY;
    CREATE POLICY upstream_states_runner_only ON upstream_states TO mcp_tasks_runner
        USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');
    GRANT SELECT ON upstream_states TO mcp_tasks_record;
    CREATE POLICY upstream_states_record_reads ON upstream_states FOR SELECT TO mcp_tasks_record
        USING (current_user = 'mcp_tasks_record');
    """)


def downgrade() -> None:
    run_script("""
    DROP TABLE upstream_states;
    """)
