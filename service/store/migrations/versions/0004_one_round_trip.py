"""The hot paths as one statement each (create, get, retrieve, finish), and active-task counters.

Revision ID: 0004
Revises: 0003

Each function does in one round trip what a transaction did in up to seven (BEGIN and the tenant
setting, lock, count, insert, audit, notify, COMMIT). Called outside a transaction, the statement is
its own transaction: the tenant setting (``set_config(..., true)``), the create lock and the audit
head lock last until it commits. The functions are SECURITY INVOKER: they run as the calling role,
under the same row-level security policies as the statements they replace, and each sets the tenant
it was given before it touches a table. The runner's ``task_finish`` runs as the runner role, whose
policy spans tenants. In PL/pgSQL every statement takes a fresh snapshot, so the counts read after
the create lock include every create committed before it.

The caps were a count(*) over the tenant's active tasks on every create: linear in the tasks a
tenant has running. ``active_tasks`` keeps one counter per requestor, maintained by triggers on
every insert, status change and delete of tasks, so a create reads counters instead (the tenant's total is
the sum over its requestors with active tasks; the sweeper drops zero rows). An active task whose
TTL ran out counts until the sweeper deletes it (one sweep interval).

``audit_canonical`` becomes PL/pgSQL: as a SQL function called from PL/pgSQL its body was parsed
and planned again in every transaction. ``audit_append`` reads the head first and creates it only
for a tenant's first event. Both produce exactly what 0003's did, so existing chains verify.
"""

from alembic import op  # noqa: F401

from service.store.migrations.sqlscript import run_script

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


_CANONICAL_0003 = """
    CREATE OR REPLACE FUNCTION audit_canonical(e audit_events) RETURNS text
    LANGUAGE sql IMMUTABLE AS $$
        SELECT jsonb_build_object(
            'tenant_id', e.tenant_id, 'seq', e.seq,
            'at', to_char(e.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
            'action', e.action, 'outcome', e.outcome, 'subject', e.subject, 'client_id', e.client_id,
            'issuer', e.issuer, 'task_id', e.task_id, 'request_id', e.request_id,
            'client_address', e.client_address, 'detail', e.detail
        )::text
    $$;
"""


def upgrade() -> None:
    run_script("""
    CREATE OR REPLACE FUNCTION audit_canonical(e audit_events) RETURNS text
    LANGUAGE plpgsql IMMUTABLE AS $$
    BEGIN
        RETURN jsonb_build_object(
            'tenant_id', e.tenant_id, 'seq', e.seq,
            'at', to_char(e.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
            'action', e.action, 'outcome', e.outcome, 'subject', e.subject, 'client_id', e.client_id,
            'issuer', e.issuer, 'task_id', e.task_id, 'request_id', e.request_id,
            'client_address', e.client_address, 'detail', e.detail
        )::text;
    END
    $$;

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

    -- No task may change between the backfill below and the triggers that keep the counts.
    LOCK TABLE tasks IN SHARE ROW EXCLUSIVE MODE;

    -- Active (working or input_required) tasks per requestor, kept by the triggers below.
    CREATE TABLE active_tasks (
        tenant_id text   NOT NULL,
        subject   text   NOT NULL,
        active    bigint NOT NULL,
        -- No CHECK (active >= 0): the delete trigger applies decrements as INSERT ... ON CONFLICT DO
        -- UPDATE with a negative value, and a CHECK is evaluated on the proposed row first.
        CONSTRAINT active_tasks_pkey PRIMARY KEY (tenant_id, subject)
    );
    INSERT INTO active_tasks (tenant_id, subject, active)
        SELECT tenant_id, subject, count(*) FROM tasks WHERE status IN ('working', 'input_required')
        GROUP BY tenant_id, subject;

    -- Every writer locks counter rows before the tenant's audit head, and a statement that changes
    -- several requestors' tasks locks their counters in (tenant, subject) order, so counters never
    -- close a deadlock cycle. Inserts and status changes come one task per statement (the reaper
    -- sorts its batch): a row trigger, which fires only when status is set. The sweeper deletes in
    -- batches: a statement trigger sums the batch and applies it in order.
    CREATE FUNCTION tasks_count_active() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        was_active boolean := false;
        is_active boolean := NEW.status IN ('working', 'input_required');
    BEGIN
        IF TG_OP = 'UPDATE' THEN
            was_active := OLD.status IN ('working', 'input_required');
        END IF;
        IF is_active AND NOT was_active THEN
            INSERT INTO active_tasks (tenant_id, subject, active) VALUES (NEW.tenant_id, NEW.subject, 1)
                ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + 1;
        ELSIF was_active AND NOT is_active THEN
            UPDATE active_tasks SET active = active - 1 WHERE tenant_id = OLD.tenant_id AND subject = OLD.subject;
        END IF;
        RETURN NULL;
    END
    $$;
    CREATE FUNCTION tasks_count_deleted() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO active_tasks (tenant_id, subject, active)
        SELECT tenant_id, subject, -count(*) FROM old_rows WHERE status IN ('working', 'input_required')
        GROUP BY tenant_id, subject ORDER BY tenant_id, subject
        ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + excluded.active;
        RETURN NULL;
    END
    $$;
    CREATE TRIGGER tasks_count_active AFTER INSERT OR UPDATE OF status ON tasks
        FOR EACH ROW EXECUTE FUNCTION tasks_count_active();
    CREATE TRIGGER tasks_count_deleted AFTER DELETE ON tasks REFERENCING OLD TABLE AS old_rows
        FOR EACH STATEMENT EXECUTE FUNCTION tasks_count_deleted();

    GRANT SELECT, INSERT, UPDATE, DELETE ON active_tasks TO mcp_tasks_app, mcp_tasks_runner;
    ALTER TABLE active_tasks ENABLE ROW LEVEL SECURITY;
    ALTER TABLE active_tasks FORCE ROW LEVEL SECURITY;
    CREATE POLICY active_tasks_tenant_isolation ON active_tasks TO mcp_tasks_app
        USING (tenant_id = current_setting('app.tenant_id', true))
        WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
    CREATE POLICY active_tasks_runner_all_tenants ON active_tasks TO mcp_tasks_runner
        USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');

    -- tasks/create: the caps, checked under the tenant's create lock, then the row, its audit event
    -- and the runners' wake-up. No row back means a cap refused it (nothing was written). With a
    -- lease owner the task is created already leased to that runner (the creating process has a free
    -- slot), so no claim and no wake-up are needed.
    CREATE FUNCTION task_create(
        p_tenant text, p_task_id text, p_subject text, p_issuer text, p_client_id text, p_session_id text,
        p_surface text, p_tool text, p_arguments jsonb, p_client_capabilities jsonb, p_progress_token jsonb,
        p_ttl_ms bigint, p_poll_interval_ms integer, p_max_per_requestor bigint, p_max_per_tenant bigint,
        p_request_id text, p_client_address text, p_detail jsonb,
        p_lease_owner text, p_lease_key bigint, p_lease_ms bigint
    ) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        mine bigint;
        total bigint;
        created tasks;
    BEGIN
        PERFORM set_config('app.tenant_id', p_tenant, true);
        PERFORM pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || p_tenant, 0));
        SELECT coalesce(sum(active) FILTER (WHERE subject = p_subject), 0), coalesce(sum(active), 0)
            INTO mine, total
        FROM active_tasks WHERE tenant_id = p_tenant AND active > 0;
        IF mine >= p_max_per_requestor OR total >= p_max_per_tenant THEN
            RETURN;
        END IF;
        INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool, arguments,
                           client_capabilities, progress_token, ttl_ms, poll_interval_ms, expires_at,
                           lease_owner, lease_key, lease_expires_at, attempts, started_at)
        VALUES (p_tenant, p_task_id, p_subject, p_issuer, p_client_id, p_session_id, p_surface, p_tool,
                p_arguments, p_client_capabilities, p_progress_token, p_ttl_ms, p_poll_interval_ms,
                clock_timestamp() + p_ttl_ms * interval '1 millisecond',
                p_lease_owner, p_lease_key, clock_timestamp() + p_lease_ms * interval '1 millisecond',
                CASE WHEN p_lease_owner IS NULL THEN 0 ELSE 1 END,
                CASE WHEN p_lease_owner IS NULL THEN NULL ELSE clock_timestamp() END)
        RETURNING * INTO created;
        PERFORM audit_append(p_tenant, 'create', 'working', p_subject, p_client_id, p_issuer, p_task_id,
                             p_request_id, p_client_address, p_detail);
        IF p_lease_owner IS NULL THEN
            PERFORM pg_notify('mcp_tasks', json_build_object('k', 'created', 't', p_tenant, 'id', p_task_id)::text);
        END IF;
        RETURN NEXT created;
    END
    $$;

    -- tasks/get: one owner's unexpired task.
    CREATE FUNCTION task_get(p_tenant text, p_task_id text, p_subject text) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM set_config('app.tenant_id', p_tenant, true);
        RETURN QUERY SELECT * FROM tasks
            WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject
              AND expires_at > clock_timestamp();
    END
    $$;

    -- tasks/result: the task, and when it is terminal the audit event saying its result was handed out.
    CREATE FUNCTION task_retrieve(
        p_tenant text, p_task_id text, p_subject text, p_client_id text, p_issuer text,
        p_request_id text, p_client_address text
    ) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        found_task tasks;
    BEGIN
        PERFORM set_config('app.tenant_id', p_tenant, true);
        SELECT * INTO found_task FROM tasks
            WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject
              AND expires_at > clock_timestamp();
        IF NOT FOUND THEN
            RETURN;
        END IF;
        IF found_task.status IN ('completed', 'failed', 'cancelled') THEN
            PERFORM audit_append(p_tenant, 'retrieve', found_task.status::text, p_subject, p_client_id, p_issuer,
                                 p_task_id, p_request_id, p_client_address, NULL);
        END IF;
        RETURN NEXT found_task;
    END
    $$;

    -- A runner records the outcome (only while it holds the lease and the task is active), appends
    -- the completion to the audit chain, and wakes whoever waits on the task.
    CREATE FUNCTION task_finish(
        p_tenant text, p_task_id text, p_owner text, p_status task_status, p_outcome text, p_payload jsonb,
        p_status_message text, p_detail jsonb
    ) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        done tasks;
    BEGIN
        UPDATE tasks
        SET status = p_status, outcome = p_outcome, payload = p_payload, status_message = p_status_message,
            last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
            lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
        WHERE tenant_id = p_tenant AND task_id = p_task_id AND lease_owner = p_owner
          AND status IN ('working', 'input_required')
        RETURNING * INTO done;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        PERFORM audit_append(p_tenant, 'complete', done.status::text, done.subject, done.client_id, done.issuer,
                             p_task_id, NULL, NULL, p_detail);
        PERFORM pg_notify('mcp_tasks', json_build_object(
            'k', 'status', 't', p_tenant, 'id', p_task_id, 's', done.session_id)::text);
        RETURN NEXT done;
    END
    $$;

    REVOKE ALL ON FUNCTION
        task_create(text, text, text, text, text, text, text, text, jsonb, jsonb, jsonb, bigint, integer, bigint,
                    bigint, text, text, jsonb, text, bigint, bigint),
        task_get(text, text, text),
        task_retrieve(text, text, text, text, text, text, text),
        task_finish(text, text, text, task_status, text, jsonb, text, jsonb)
    FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION
        task_create(text, text, text, text, text, text, text, text, jsonb, jsonb, jsonb, bigint, integer, bigint,
                    bigint, text, text, jsonb, text, bigint, bigint),
        task_get(text, text, text),
        task_retrieve(text, text, text, text, text, text, text)
    TO mcp_tasks_app;
    GRANT EXECUTE ON FUNCTION task_finish(text, text, text, task_status, text, jsonb, text, jsonb) TO mcp_tasks_runner;
    """)


def downgrade() -> None:
    # audit_append keeps its 0004 body: it appends exactly what 0003's did.
    run_script(_CANONICAL_0003)
    run_script("""
    DROP TRIGGER tasks_count_deleted ON tasks;
    DROP TRIGGER tasks_count_active ON tasks;
    DROP FUNCTION tasks_count_deleted();
    DROP FUNCTION tasks_count_active();
    DROP TABLE active_tasks;
    DROP FUNCTION task_finish(text, text, text, task_status, text, jsonb, text, jsonb);
    DROP FUNCTION task_retrieve(text, text, text, text, text, text, text);
    DROP FUNCTION task_get(text, text, text);
    DROP FUNCTION task_create(text, text, text, text, text, text, text, text, jsonb, jsonb, jsonb, bigint, integer,
                              bigint, bigint, text, text, jsonb, text, bigint, bigint);
    """)
