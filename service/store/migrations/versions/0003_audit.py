"""Audit events: append-only, one SHA-256 hash chain per tenant.

Revision ID: 0003
Revises: 0002

Each row's hash is sha256(prev_hash || canonical(row)), where canonical(row) is the jsonb text of
the row's fields (jsonb text output is deterministic: sorted keys, fixed formatting; times are
rendered in UTC). ``audit_heads`` holds each tenant's last seq and hash; appending locks that row,
so a tenant's events are numbered without gaps even with many replicas. The service's roles may
only INSERT and SELECT events; a trigger refuses UPDATE and DELETE for everyone.
"""

from alembic import op  # noqa: F401

from service.store.migrations.sqlscript import run_script

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    CREATE TABLE audit_events (
        tenant_id      text        NOT NULL,
        seq            bigint      NOT NULL,
        at             timestamptz NOT NULL DEFAULT clock_timestamp(),
        action         text        NOT NULL,
        outcome        text        NOT NULL,
        subject        text        NOT NULL DEFAULT '',
        client_id      text        NOT NULL DEFAULT '',
        issuer         text        NOT NULL DEFAULT '',
        task_id        text,
        request_id     text,
        client_address text,
        detail         jsonb,
        prev_hash      bytea       NOT NULL,
        hash           bytea       NOT NULL,
        CONSTRAINT audit_events_pkey PRIMARY KEY (tenant_id, seq),
        CONSTRAINT audit_events_action_known CHECK (action IN
            ('create', 'complete', 'retrieve', 'cancel', 'input', 'expire', 'deny')),
        CONSTRAINT audit_events_seq_positive CHECK (seq > 0),
        CONSTRAINT audit_events_hash_size CHECK (octet_length(hash) = 32 AND octet_length(prev_hash) = 32)
    );
    CREATE INDEX audit_events_time ON audit_events (tenant_id, at);

    CREATE TABLE audit_heads (
        tenant_id text   NOT NULL,
        seq       bigint NOT NULL,
        hash      bytea  NOT NULL,
        CONSTRAINT audit_heads_pkey PRIMARY KEY (tenant_id)
    );

    -- The canonical text of an event, hashed into the chain; also used by `mcp-tasks audit verify`.
    CREATE FUNCTION audit_canonical(e audit_events) RETURNS text
    LANGUAGE sql IMMUTABLE AS $$
        SELECT jsonb_build_object(
            'tenant_id', e.tenant_id, 'seq', e.seq,
            'at', to_char(e.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
            'action', e.action, 'outcome', e.outcome, 'subject', e.subject, 'client_id', e.client_id,
            'issuer', e.issuer, 'task_id', e.task_id, 'request_id', e.request_id,
            'client_address', e.client_address, 'detail', e.detail
        )::text
    $$;

    -- Append one event to its tenant's chain (one round trip, in the caller's transaction).
    CREATE FUNCTION audit_append(
        p_tenant text, p_action text, p_outcome text, p_subject text, p_client_id text, p_issuer text,
        p_task_id text, p_request_id text, p_client_address text, p_detail jsonb
    ) RETURNS bigint
    LANGUAGE plpgsql AS $$
    DECLARE
        head audit_heads;
        e audit_events;
    BEGIN
        INSERT INTO audit_heads (tenant_id, seq, hash) VALUES (p_tenant, 0, decode(repeat('00', 32), 'hex'))
            ON CONFLICT (tenant_id) DO NOTHING;
        SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
        e.tenant_id := p_tenant; e.seq := head.seq + 1; e.at := clock_timestamp();
        e.action := p_action; e.outcome := p_outcome;
        e.subject := coalesce(p_subject, ''); e.client_id := coalesce(p_client_id, '');
        e.issuer := coalesce(p_issuer, ''); e.task_id := p_task_id; e.request_id := p_request_id;
        e.client_address := p_client_address; e.detail := p_detail; e.prev_hash := head.hash;
        e.hash := sha256(head.hash || convert_to(audit_canonical(e), 'UTF8'));
        INSERT INTO audit_events VALUES (e.*);
        UPDATE audit_heads SET seq = e.seq, hash = e.hash WHERE tenant_id = p_tenant;
        RETURN e.seq;
    END
    $$;

    CREATE FUNCTION audit_events_append_only() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'audit_events is append-only: % is not allowed', TG_OP
            USING ERRCODE = 'insufficient_privilege';
    END
    $$;
    CREATE TRIGGER audit_events_no_update_delete BEFORE UPDATE OR DELETE ON audit_events
        FOR EACH ROW EXECUTE FUNCTION audit_events_append_only();
    CREATE TRIGGER audit_events_no_truncate BEFORE TRUNCATE ON audit_events
        FOR EACH STATEMENT EXECUTE FUNCTION audit_events_append_only();

    GRANT SELECT, INSERT ON audit_events TO mcp_tasks_app, mcp_tasks_runner;
    GRANT SELECT, INSERT, UPDATE ON audit_heads TO mcp_tasks_app, mcp_tasks_runner;
    GRANT EXECUTE ON FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb),
        audit_canonical(audit_events) TO mcp_tasks_app, mcp_tasks_runner;

    ALTER TABLE audit_events ENABLE ROW LEVEL SECURITY;
    ALTER TABLE audit_events FORCE ROW LEVEL SECURITY;
    CREATE POLICY audit_events_tenant_isolation ON audit_events TO mcp_tasks_app
        USING (tenant_id = current_setting('app.tenant_id', true))
        WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
    CREATE POLICY audit_events_runner_all_tenants ON audit_events TO mcp_tasks_runner
        USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');
    ALTER TABLE audit_heads ENABLE ROW LEVEL SECURITY;
    ALTER TABLE audit_heads FORCE ROW LEVEL SECURITY;
    CREATE POLICY audit_heads_tenant_isolation ON audit_heads TO mcp_tasks_app
        USING (tenant_id = current_setting('app.tenant_id', true))
        WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
    CREATE POLICY audit_heads_runner_all_tenants ON audit_heads TO mcp_tasks_runner
        USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');
    """)


def downgrade() -> None:
    run_script("""
    DROP TABLE audit_heads;
    DROP TRIGGER audit_events_no_truncate ON audit_events;
    DROP TRIGGER audit_events_no_update_delete ON audit_events;
    DROP TABLE audit_events CASCADE;
    DROP FUNCTION audit_events_append_only();
    DROP FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb);
    """)
