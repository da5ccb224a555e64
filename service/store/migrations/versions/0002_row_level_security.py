"""Row-level security: tenant isolation for the service's role, all tenants for runners.

Revision ID: 0002
Revises: 0001

Two NOLOGIN roles, shared by every database of the cluster (so they are created once and never
dropped by a downgrade, which could break another database):

- ``mcp_tasks_app`` handles requests: it sees and writes only rows whose tenant_id equals
  ``current_setting('app.tenant_id')``, set per transaction; no tenant set means no rows.
- ``mcp_tasks_runner`` claims, reaps and sweeps across tenants.

The service's login user is a member of both and acts as one of them per connection pool (the
``role`` startup parameter). Policies apply to members of a role too, so the all-tenants policy
also requires ``current_user`` to be the runner role: a login user that merely inherits it sees
nothing. FORCE makes the policies apply to the tables' owner too.
"""

from alembic import op  # noqa: F401

from service.store.migrations.sqlscript import run_script

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TENANT_TABLES = ("tasks", "task_messages", "sessions")


def upgrade() -> None:
    run_script("""
    DO $$
    BEGIN
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mcp_tasks_app') THEN
            CREATE ROLE mcp_tasks_app NOLOGIN NOBYPASSRLS;
        END IF;
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mcp_tasks_runner') THEN
            CREATE ROLE mcp_tasks_runner NOLOGIN NOBYPASSRLS;
        END IF;
    END
    $$;
    GRANT USAGE ON SCHEMA public TO mcp_tasks_app, mcp_tasks_runner;
    GRANT SELECT ON alembic_version TO mcp_tasks_app, mcp_tasks_runner;
    GRANT SELECT, INSERT ON service_keys TO mcp_tasks_app, mcp_tasks_runner;
    """)
    for table in TENANT_TABLES:
        run_script(f"""
        GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO mcp_tasks_app, mcp_tasks_runner;
        ALTER TABLE {table} ENABLE ROW LEVEL SECURITY;
        ALTER TABLE {table} FORCE ROW LEVEL SECURITY;
        CREATE POLICY {table}_tenant_isolation ON {table} TO mcp_tasks_app
            USING (tenant_id = current_setting('app.tenant_id', true))
            WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
        CREATE POLICY {table}_runner_all_tenants ON {table} TO mcp_tasks_runner
            USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');
        """)


def downgrade() -> None:
    for table in TENANT_TABLES:
        run_script(f"""
        DROP POLICY {table}_runner_all_tenants ON {table};
        DROP POLICY {table}_tenant_isolation ON {table};
        ALTER TABLE {table} NO FORCE ROW LEVEL SECURITY;
        ALTER TABLE {table} DISABLE ROW LEVEL SECURITY;
        REVOKE ALL ON {table} FROM mcp_tasks_app, mcp_tasks_runner;
        """)
    run_script("""
    REVOKE ALL ON service_keys FROM mcp_tasks_app, mcp_tasks_runner;
    REVOKE ALL ON alembic_version FROM mcp_tasks_app, mcp_tasks_runner;
    REVOKE USAGE ON SCHEMA public FROM mcp_tasks_app, mcp_tasks_runner;
    """)
