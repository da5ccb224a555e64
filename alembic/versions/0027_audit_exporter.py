"""Only the export path marks the record exported (issue 42, point 4): a fourth NOLOGIN role,
mcp_tasks_exporter, which the service's login is never a member of, is the only one that may say how
far a chain was written out (audit_mark_exported_v2, which also records an `export` event in the
chain); the runner role keeps audit_purge, which removes only what an export covered, and loses
audit_mark_exported. audit_heads.receipts_from_seq: from which seq on every purge must follow an
export event that covers it (`mcp-tasks audit verify` checks it; chains before this revision start
from their head).

Revision ID: 0027
Revises: 0026

Append-only: once committed, this file never changes (docs/decisions.md). A changed SQL function
is created here with its full new body; alembic/schema.sql gets the same change.
"""

from service.store.sqlscript import run_script

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    DO $$
    BEGIN
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mcp_tasks_exporter') THEN
            CREATE ROLE mcp_tasks_exporter NOLOGIN NOBYPASSRLS;
        END IF;
    END
    $$;
    GRANT USAGE ON SCHEMA public TO mcp_tasks_exporter;
    GRANT SELECT ON alembic_version TO mcp_tasks_exporter;  -- the export checks the schema's version
    DO $$
    BEGIN
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO mcp_tasks_exporter', current_database());
    END
    $$;

    -- A new action, `export`: checked for new rows at once, the old ones read without blocking writes.
    ALTER TABLE audit_events DROP CONSTRAINT audit_events_action_known;
    ALTER TABLE audit_events ADD CONSTRAINT audit_events_action_known CHECK (action IN
        ('create', 'complete', 'retrieve', 'cancel', 'input', 'expire', 'deny', 'requeue', 'purge', 'export'))
        NOT VALID;
    ALTER TABLE audit_events VALIDATE CONSTRAINT audit_events_action_known;

    ALTER TABLE audit_heads ADD COLUMN receipts_from_seq bigint NOT NULL DEFAULT 0;
    UPDATE audit_heads SET receipts_from_seq = seq;

    GRANT SELECT ON audit_events, audit_heads TO mcp_tasks_exporter;
    CREATE POLICY audit_events_exporter_all_tenants ON audit_events TO mcp_tasks_exporter
        USING (current_user = 'mcp_tasks_exporter');
    CREATE POLICY audit_heads_exporter_all_tenants ON audit_heads TO mcp_tasks_exporter
        USING (current_user = 'mcp_tasks_exporter');

    -- The export path wrote a tenant's chain from its start up to p_seq: those rows may be purged,
    -- and the chain says so (an `export` event naming how far, and the login that exported).
    CREATE FUNCTION audit_mark_exported_v2(p_tenant text, p_seq bigint) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
    DECLARE
        was bigint;
        now_at bigint;
    BEGIN
        SELECT exported_seq INTO was FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        UPDATE audit_heads SET exported_seq = greatest(exported_seq, least(p_seq, seq))
        WHERE tenant_id = p_tenant
        RETURNING exported_seq INTO now_at;
        IF now_at > was THEN
            PERFORM audit_append(p_tenant, 'export', 'ok', '', '', '', NULL, NULL, NULL,
                                 jsonb_build_object('through_seq', now_at, 'login', session_user::text));
        END IF;
        RETURN now_at;
    END
    $$;
    ALTER FUNCTION audit_mark_exported_v2(text, bigint) OWNER TO mcp_tasks_record;
    REVOKE ALL ON FUNCTION audit_mark_exported_v2(text, bigint) FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION audit_mark_exported_v2(text, bigint), audit_purge(text, timestamptz)
        TO mcp_tasks_exporter;
    REVOKE EXECUTE ON FUNCTION audit_mark_exported(text, bigint) FROM mcp_tasks_runner;
    """)


def downgrade() -> None:
    run_script("""
    GRANT EXECUTE ON FUNCTION audit_mark_exported(text, bigint) TO mcp_tasks_runner;
    REVOKE EXECUTE ON FUNCTION audit_purge(text, timestamptz) FROM mcp_tasks_exporter;
    DROP FUNCTION audit_mark_exported_v2(text, bigint);
    DROP POLICY audit_heads_exporter_all_tenants ON audit_heads;
    DROP POLICY audit_events_exporter_all_tenants ON audit_events;
    REVOKE SELECT ON audit_events, audit_heads FROM mcp_tasks_exporter;
    ALTER TABLE audit_heads DROP COLUMN receipts_from_seq;
    ALTER TABLE audit_events DROP CONSTRAINT audit_events_action_known;
    ALTER TABLE audit_events ADD CONSTRAINT audit_events_action_known CHECK (action IN
        ('create', 'complete', 'retrieve', 'cancel', 'input', 'expire', 'deny', 'requeue', 'purge')) NOT VALID;
    -- (a chain that has export events keeps them: the old check is back for new rows only)
    DO $$
    BEGIN
        EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM mcp_tasks_exporter', current_database());
    END
    $$;
    REVOKE SELECT ON alembic_version FROM mcp_tasks_exporter;
    REVOKE USAGE ON SCHEMA public FROM mcp_tasks_exporter;
    """)
