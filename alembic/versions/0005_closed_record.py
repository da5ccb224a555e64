"""A closed event bus, and a record the service's own database credentials cannot forge.

Revision ID: 0005
Revises: 0004

Issue 14, findings 3, 5 and 7:
- CONNECT and TEMPORARY on the service's database are revoked from PUBLIC; the service's roles get
  CONNECT (its login user connects through its membership). Only they can LISTEN, NOTIFY or take
  advisory locks there.
- ``mcp_tasks_record`` (NOLOGIN; the login user is never a member) owns ``audit_append``, the new
  ``audit_mark_exported`` and ``audit_purge``, and ``task_finish_batch`` / ``task_release_batch``
  (their bodies unchanged: ALTER only), all SECURITY DEFINER with a fixed search_path. The service's
  roles lose INSERT on ``audit_events``, INSERT/UPDATE on ``audit_heads``, and UPDATE of a task's
  outcome columns; a task is inserted working and deleted only once expired.
- ``audit_append`` takes the time itself, never earlier than its chain's last event, and records
  a finished task's repeated retrievals once per requestor per interval (``audit_retrievals``).
- Retention: ``audit_heads`` keeps what was exported and the last purged row (a checkpoint the
  next row links to); a purge is itself an event (action ``purge``).
"""

from service.store.sqlscript import run_script

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
-- The role that owns the record: NOLOGIN, and the service's login user is never made a member of it.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mcp_tasks_record') THEN
        CREATE ROLE mcp_tasks_record NOLOGIN NOBYPASSRLS;
    END IF;
END
$$;
GRANT USAGE ON SCHEMA public TO mcp_tasks_record;
-- The schema owner hands functions to mcp_tasks_record: it must be able to act as that role (a
-- superuser can; a CREATEROLE owner grants itself membership), and the role may own objects here.
DO $$
BEGIN
    IF NOT pg_has_role(current_user, 'mcp_tasks_record', 'MEMBER') THEN
        EXECUTE format('GRANT mcp_tasks_record TO %I', current_user);
    END IF;
END
$$;
GRANT CREATE ON SCHEMA public TO mcp_tasks_record;

-- A closed event bus: only the service's roles may connect to its database (so LISTEN, NOTIFY and
-- advisory locks are theirs alone), and nobody may create temporary tables.
DO $$
BEGIN
    EXECUTE format('REVOKE CONNECT, TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO mcp_tasks_app, mcp_tasks_runner', current_database());
END
$$;

-- Task outcomes: written only through task_finish_batch and task_release_batch (which check the
-- lease and run as mcp_tasks_record). The service's roles update only the columns their
-- statements set; a task is inserted working, and deleted only once expired.
REVOKE UPDATE ON tasks FROM mcp_tasks_app, mcp_tasks_runner;
GRANT UPDATE (status, status_message, last_updated_at, finished_at, lease_owner, lease_key, lease_expires_at)
    ON tasks TO mcp_tasks_app;
GRANT UPDATE (status, status_message, last_updated_at, lease_owner, lease_key, lease_expires_at, attempts,
              started_at, lease_epoch)
    ON tasks TO mcp_tasks_runner;
CREATE POLICY tasks_inserted_working ON tasks AS RESTRICTIVE FOR INSERT TO mcp_tasks_app, mcp_tasks_runner
    WITH CHECK (status = 'working' AND outcome IS NULL AND payload IS NULL AND finished_at IS NULL);
CREATE POLICY tasks_deleted_expired ON tasks AS RESTRICTIVE FOR DELETE TO mcp_tasks_app, mcp_tasks_runner
    USING (expires_at <= clock_timestamp());
-- A finished task is not changed by the service's roles at all (nor locked for update), until it
-- has expired and the sweeper deletes it.
CREATE POLICY tasks_finished_unchanged ON tasks AS RESTRICTIVE FOR UPDATE TO mcp_tasks_app, mcp_tasks_runner
    USING (task_status_active(status) OR expires_at <= clock_timestamp()) WITH CHECK (true);
GRANT SELECT, UPDATE ON tasks TO mcp_tasks_record;
GRANT SELECT, INSERT, UPDATE ON active_tasks TO mcp_tasks_record;
GRANT SELECT, DELETE ON task_messages TO mcp_tasks_record;
CREATE POLICY tasks_record ON tasks TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');
CREATE POLICY active_tasks_record ON active_tasks TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');
CREATE POLICY task_messages_record ON task_messages TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');
ALTER FUNCTION task_finish_batch(jsonb) OWNER TO mcp_tasks_record;
ALTER FUNCTION task_finish_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;
ALTER FUNCTION task_release_batch(jsonb) OWNER TO mcp_tasks_record;
ALTER FUNCTION task_release_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;

-- The audit chain: appended only by audit_append, which runs as mcp_tasks_record, takes the time
-- itself (never earlier than the chain's last event) and computes the hash.
ALTER TABLE audit_events DROP CONSTRAINT audit_events_action_known;
ALTER TABLE audit_events ADD CONSTRAINT audit_events_action_known CHECK (action IN
    ('create', 'complete', 'retrieve', 'cancel', 'input', 'expire', 'deny', 'requeue', 'purge'));
ALTER TABLE audit_heads
    ADD COLUMN at timestamptz,
    ADD COLUMN exported_seq bigint NOT NULL DEFAULT 0,
    ADD COLUMN purged_seq bigint NOT NULL DEFAULT 0,
    ADD COLUMN purged_hash bytea NOT NULL DEFAULT decode(repeat('00', 32), 'hex'),
    ADD CONSTRAINT audit_heads_purged_after_export CHECK (purged_seq <= exported_seq AND exported_seq <= seq);

CREATE TABLE audit_retrievals (
    tenant_id  text        NOT NULL,
    task_id    text        NOT NULL,
    subject    text        NOT NULL,
    audited_at timestamptz NOT NULL,
    repeats    bigint      NOT NULL DEFAULT 0,
    CONSTRAINT audit_retrievals_pkey PRIMARY KEY (tenant_id, task_id, subject),
    CONSTRAINT audit_retrievals_task_fkey FOREIGN KEY (tenant_id, task_id)
        REFERENCES tasks (tenant_id, task_id) ON DELETE CASCADE
);
GRANT SELECT, INSERT, UPDATE ON audit_retrievals TO mcp_tasks_record;
ALTER TABLE audit_retrievals ENABLE ROW LEVEL SECURITY;
ALTER TABLE audit_retrievals FORCE ROW LEVEL SECURITY;
CREATE POLICY audit_retrievals_record ON audit_retrievals TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');

CREATE OR REPLACE FUNCTION audit_append(
    p_tenant text, p_action text, p_outcome text, p_subject text, p_client_id text, p_issuer text,
    p_task_id text, p_request_id text, p_client_address text, p_detail jsonb
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    head audit_heads;
    e audit_events;
    seen audit_retrievals;
    every_s double precision;
BEGIN
    -- Row-level security held the request role to its tenant; this function runs as its owner.
    IF current_setting('role') = 'mcp_tasks_app' AND p_tenant IS DISTINCT FROM current_setting('app.tenant_id', true) THEN
        RAISE EXCEPTION 'audit_append: % is not the transaction''s tenant', p_tenant
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- A finished task's result handed out again: recorded once per requestor per interval, the
    -- repeats counted into the next event (migration 0005, docs/decisions.md).
    IF p_action = 'retrieve' AND p_task_id IS NOT NULL THEN
        every_s := coalesce(nullif(current_setting('mcp_tasks.audit_retrieve_interval_s', true), ''), '3600')::double precision;
        IF every_s > 0 THEN
            PERFORM 1 FROM tasks WHERE tenant_id = p_tenant AND task_id = p_task_id FOR KEY SHARE;
        END IF;
        IF every_s > 0 AND FOUND THEN
            INSERT INTO audit_retrievals (tenant_id, task_id, subject, audited_at, repeats)
            VALUES (p_tenant, p_task_id, coalesce(p_subject, ''), '-infinity', 0)
            ON CONFLICT (tenant_id, task_id, subject) DO NOTHING;
            SELECT * INTO seen FROM audit_retrievals
            WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = coalesce(p_subject, '') FOR UPDATE;
            IF seen.audited_at > clock_timestamp() - every_s * interval '1 second' THEN
                UPDATE audit_retrievals SET repeats = repeats + 1
                WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = coalesce(p_subject, '');
                RETURN NULL;
            END IF;
            UPDATE audit_retrievals SET audited_at = clock_timestamp(), repeats = 0
            WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = coalesce(p_subject, '');
            IF seen.repeats > 0 THEN
                p_detail := coalesce(p_detail, '{}') || jsonb_build_object('repeats_before', seen.repeats);
            END IF;
        END IF;
    END IF;
    SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    IF NOT FOUND THEN  -- the tenant's first event
        INSERT INTO audit_heads (tenant_id, seq, hash) VALUES (p_tenant, 0, decode(repeat('00', 32), 'hex'))
            ON CONFLICT (tenant_id) DO NOTHING;
        SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    END IF;
    e.tenant_id := p_tenant; e.seq := head.seq + 1; e.at := greatest(clock_timestamp(), head.at);
    e.action := p_action; e.outcome := p_outcome;
    e.subject := coalesce(p_subject, ''); e.client_id := coalesce(p_client_id, '');
    e.issuer := coalesce(p_issuer, ''); e.task_id := p_task_id; e.request_id := p_request_id;
    e.client_address := p_client_address; e.detail := p_detail; e.prev_hash := head.hash;
    e.hash := sha256(head.hash || convert_to(audit_canonical(e), 'UTF8'));
    INSERT INTO audit_events VALUES (e.*);
    UPDATE audit_heads SET seq = e.seq, hash = e.hash, at = e.at WHERE tenant_id = p_tenant;
    RETURN e.seq;
END
$$;
ALTER FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb) OWNER TO mcp_tasks_record;

-- `mcp-tasks audit export` read a tenant's chain from its start up to p_seq: those rows may be purged.
CREATE FUNCTION audit_mark_exported(p_tenant text, p_seq bigint) RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, public
BEGIN ATOMIC
    UPDATE audit_heads SET exported_seq = greatest(exported_seq, least(p_seq, seq))
    WHERE tenant_id = p_tenant
    RETURNING exported_seq;
END;
ALTER FUNCTION audit_mark_exported(text, bigint) OWNER TO mcp_tasks_record;

-- Retention: a tenant's exported events older than p_before go. The chain stays verifiable: the
-- head keeps the last purged row's seq and hash (the next row links to it), and the purge itself
-- is an event of the chain.
CREATE FUNCTION audit_purge(p_tenant text, p_before timestamptz) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    head audit_heads;
    last_gone audit_events;
    removed bigint;
BEGIN
    SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    SELECT * INTO last_gone FROM audit_events
    WHERE tenant_id = p_tenant AND seq > head.purged_seq AND seq <= head.exported_seq AND at < p_before
    ORDER BY seq DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    DELETE FROM audit_events WHERE tenant_id = p_tenant AND seq <= last_gone.seq;
    GET DIAGNOSTICS removed = ROW_COUNT;
    UPDATE audit_heads SET purged_seq = last_gone.seq, purged_hash = last_gone.hash WHERE tenant_id = p_tenant;
    PERFORM audit_append(p_tenant, 'purge', 'ok', '', '', '', NULL, NULL, NULL,
                         jsonb_build_object('through_seq', last_gone.seq, 'rows', removed,
                                            'before', to_char(p_before AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')));
    RETURN removed;
END
$$;
ALTER FUNCTION audit_purge(text, timestamptz) OWNER TO mcp_tasks_record;

-- Only audit_purge (running as mcp_tasks_record) may delete events; nobody may change them.
CREATE OR REPLACE FUNCTION audit_events_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_user = 'mcp_tasks_record' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'audit_events is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$;

REVOKE INSERT ON audit_events FROM mcp_tasks_app, mcp_tasks_runner;
REVOKE INSERT, UPDATE ON audit_heads FROM mcp_tasks_app, mcp_tasks_runner;
GRANT SELECT, INSERT, DELETE ON audit_events TO mcp_tasks_record;
GRANT SELECT, INSERT, UPDATE ON audit_heads TO mcp_tasks_record;
CREATE POLICY audit_events_record ON audit_events TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');
CREATE POLICY audit_heads_record ON audit_heads TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');
REVOKE ALL ON FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb),
    audit_mark_exported(text, bigint), audit_purge(text, timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb)
    TO mcp_tasks_app, mcp_tasks_runner;
GRANT EXECUTE ON FUNCTION audit_mark_exported(text, bigint), audit_purge(text, timestamptz) TO mcp_tasks_runner;
    """)


def downgrade() -> None:
    run_script("""
DO $$
BEGIN
    IF EXISTS (SELECT FROM audit_heads WHERE purged_seq > 0) THEN
        RAISE EXCEPTION 'audit events were purged (retention): the previous schema cannot verify these chains';
    END IF;
END
$$;
DROP POLICY audit_heads_record ON audit_heads;
DROP POLICY audit_events_record ON audit_events;
REVOKE ALL ON audit_heads, audit_events FROM mcp_tasks_record;
GRANT INSERT ON audit_events TO mcp_tasks_app, mcp_tasks_runner;
GRANT INSERT, UPDATE ON audit_heads TO mcp_tasks_app, mcp_tasks_runner;
CREATE OR REPLACE FUNCTION audit_events_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_events is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$;
DROP FUNCTION audit_purge(text, timestamptz);
DROP FUNCTION audit_mark_exported(text, bigint);
ALTER FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb) OWNER TO CURRENT_USER;
CREATE OR REPLACE FUNCTION audit_append(
    p_tenant text, p_action text, p_outcome text, p_subject text, p_client_id text, p_issuer text,
    p_task_id text, p_request_id text, p_client_address text, p_detail jsonb
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    head audit_heads;
    e audit_events;
BEGIN
    SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    IF NOT FOUND THEN  -- the tenant's first event
        INSERT INTO audit_heads (tenant_id, seq, hash) VALUES (p_tenant, 0, decode(repeat('00', 32), 'hex'))
            ON CONFLICT (tenant_id) DO NOTHING;
        SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    END IF;
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
ALTER FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb)
    SECURITY INVOKER RESET search_path;
GRANT EXECUTE ON FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb)
    TO PUBLIC;
DROP TABLE audit_retrievals;
ALTER TABLE audit_heads DROP CONSTRAINT audit_heads_purged_after_export,
    DROP COLUMN purged_hash, DROP COLUMN purged_seq, DROP COLUMN exported_seq, DROP COLUMN at;
ALTER TABLE audit_events DROP CONSTRAINT audit_events_action_known;
ALTER TABLE audit_events ADD CONSTRAINT audit_events_action_known CHECK (action IN
    ('create', 'complete', 'retrieve', 'cancel', 'input', 'expire', 'deny', 'requeue'));

ALTER FUNCTION task_release_batch(jsonb) SECURITY INVOKER RESET search_path;
ALTER FUNCTION task_release_batch(jsonb) OWNER TO CURRENT_USER;
ALTER FUNCTION task_finish_batch(jsonb) SECURITY INVOKER RESET search_path;
ALTER FUNCTION task_finish_batch(jsonb) OWNER TO CURRENT_USER;
DROP POLICY task_messages_record ON task_messages;
DROP POLICY active_tasks_record ON active_tasks;
DROP POLICY tasks_record ON tasks;
REVOKE ALL ON tasks, active_tasks, task_messages FROM mcp_tasks_record;
DROP POLICY tasks_finished_unchanged ON tasks;
DROP POLICY tasks_deleted_expired ON tasks;
DROP POLICY tasks_inserted_working ON tasks;
REVOKE UPDATE (status, status_message, last_updated_at, finished_at, lease_owner, lease_key, lease_expires_at)
    ON tasks FROM mcp_tasks_app;
REVOKE UPDATE (status, status_message, last_updated_at, lease_owner, lease_key, lease_expires_at, attempts,
               started_at, lease_epoch)
    ON tasks FROM mcp_tasks_runner;
GRANT UPDATE ON tasks TO mcp_tasks_app, mcp_tasks_runner;

DO $$
BEGIN
    EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM mcp_tasks_app, mcp_tasks_runner', current_database());
    EXECUTE format('GRANT CONNECT, TEMPORARY ON DATABASE %I TO PUBLIC', current_database());
END
$$;
-- The schema owner's membership in mcp_tasks_record stays: roles are shared by the cluster.
REVOKE USAGE, CREATE ON SCHEMA public FROM mcp_tasks_record;
    """)
