"""Plain calls per tenant, tool and hour for `mcp-tasks usage` (issue 45, point 5): a table only
the runner role reads and writes, which each process's maintenance pass adds its counts to.

Revision ID: 0024
Revises: 0023

Append-only: once committed, this file never changes (docs/decisions.md). A changed SQL function
is created here with its full new body; alembic/schema.sql gets the same change.
"""

from service.store.sqlscript import run_script

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    -- ===================================================================================== usage ==
    -- Plain calls (answered inside their request, never a task) per tenant, tool and hour (UTC), for
    -- `mcp-tasks usage`: they are not in the audit record (a row each would cost a plain call more
    -- than its answer). Each process counts them in memory and its maintenance pass adds its counts
    -- here (and at shutdown): a crash loses at most one pass's counts. Only the runner role, which
    -- reports across tenants, reads or writes them.
    CREATE TABLE usage_plain_calls (
        tenant_id text        NOT NULL,
        tool      text        NOT NULL,
        hour      timestamptz NOT NULL,
        calls     bigint      NOT NULL,
        CONSTRAINT usage_plain_calls_pkey PRIMARY KEY (tenant_id, tool, hour),
        CONSTRAINT usage_plain_calls_counted CHECK (calls > 0),
        CONSTRAINT usage_plain_calls_on_the_hour CHECK (hour = date_trunc('hour', hour, 'UTC'))
    );

    GRANT SELECT, INSERT, UPDATE ON usage_plain_calls TO mcp_tasks_runner;
    ALTER TABLE usage_plain_calls ENABLE ROW LEVEL SECURITY;
    ALTER TABLE usage_plain_calls FORCE ROW LEVEL SECURITY;
    CREATE POLICY usage_plain_calls_runner_only ON usage_plain_calls TO mcp_tasks_runner
        USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');
    """)


def downgrade() -> None:
    run_script("""
    DROP TABLE usage_plain_calls;
    """)
