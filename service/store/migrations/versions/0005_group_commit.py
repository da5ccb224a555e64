"""Group commit: many creates, lookups and finishes in one statement and one commit.

Revision ID: 0005
Revises: 0004

``task_batch`` does what 0004's ``task_create``, ``task_get`` and ``task_retrieve`` do, for a
whole batch of requests from many tenants and requestors, and ``task_finish_batch`` what
``task_finish`` does for many runner outcomes. The service sends the requests that arrive while
the previous batch is in flight as the next batch (see ``service/store/batch.py``): under load, a
round trip, a statement and a durable commit are shared by many requests, and the listening
replicas are woken once per commit instead of once per task. Each request is answered only after
the commit, as before.

Locks are taken in the order every other writer takes them, so batches deadlock neither with each
other nor with single statements: the tenants' create locks (sorted), then the tasks' rows, then
their requestors' counters in (tenant, subject, task) order (the caller sorts the batch; a finish
batch locks all its rows before it changes any), then the tenants' audit heads, in tenant order.
Every such order compares code points (``COLLATE "C"``, as Python sorts), whatever the database's
collation; the sweeper's counter trigger is redefined to match. Each item sets its own tenant before it touches a table, so
row-level security applies per item exactly as it does to the single-item functions.

The results come back one row per item, in the order of the items; a row of NULLs means "no task":
a cap refused the create, or the task is unknown, expired or someone else's.
"""

from alembic import op  # noqa: F401

from service.store.migrations.sqlscript import run_script

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    -- One request of a batch: k is 'create', 'retrieve' or 'get'; a create uses every field.
    CREATE TYPE task_batch_item AS (
        k text, tenant_id text, task_id text, subject text, issuer text, client_id text, session_id text,
        surface text, tool text, arguments jsonb, client_capabilities jsonb, progress_token jsonb,
        ttl_ms bigint, poll_interval_ms integer, max_per_requestor bigint, max_per_tenant bigint,
        request_id text, client_address text, detail jsonb,
        lease_owner text, lease_key bigint, lease_ms bigint
    );

    CREATE FUNCTION task_batch(p_items jsonb) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        items task_batch_item[];
        it task_batch_item;
        found_tasks tasks[];
        t tasks;
        lock_tenant text;
        mine bigint;
        total bigint;
        n integer;
    BEGIN
        SELECT array_agg(jsonb_populate_record(NULL::task_batch_item, e) ORDER BY o) INTO items
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
        n := coalesce(array_length(items, 1), 0);
        -- The create locks of every tenant that creates, in tenant order, held until commit.
        FOR lock_tenant IN
            SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u WHERE u.k = 'create' ORDER BY 1
        LOOP
            PERFORM pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || lock_tenant, 0));
        END LOOP;
        -- The rows, in the caller's (tenant, subject, task) order: the counter triggers lock in that order.
        FOR i IN 1 .. n LOOP
            it := items[i];
            t := NULL;
            PERFORM set_config('app.tenant_id', it.tenant_id, true);
            IF it.k = 'create' THEN
                SELECT coalesce(sum(active) FILTER (WHERE subject = it.subject), 0), coalesce(sum(active), 0)
                    INTO mine, total
                FROM active_tasks WHERE tenant_id = it.tenant_id AND active > 0;
                IF mine < it.max_per_requestor AND total < it.max_per_tenant THEN
                    INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool,
                                       arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                       expires_at, lease_owner, lease_key, lease_expires_at, attempts, started_at)
                    VALUES (it.tenant_id, it.task_id, it.subject, it.issuer, it.client_id, it.session_id, it.surface,
                            it.tool, it.arguments, it.client_capabilities, it.progress_token, it.ttl_ms,
                            it.poll_interval_ms, clock_timestamp() + it.ttl_ms * interval '1 millisecond',
                            it.lease_owner, it.lease_key, clock_timestamp() + it.lease_ms * interval '1 millisecond',
                            CASE WHEN it.lease_owner IS NULL THEN 0 ELSE 1 END,
                            CASE WHEN it.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END)
                    RETURNING * INTO t;
                END IF;
            ELSIF it.k IN ('retrieve', 'get') THEN
                SELECT * INTO t FROM tasks
                WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND subject = it.subject
                  AND expires_at > clock_timestamp();
            ELSE
                RAISE EXCEPTION 'unknown batch item kind %', it.k USING ERRCODE = 'invalid_parameter_value';
            END IF;
            found_tasks[i] := t;
        END LOOP;
        -- Then the audit events, tenant by tenant: audit heads after counters, as every writer.
        FOR i IN 1 .. n LOOP
            it := items[i];
            t := found_tasks[i];
            CONTINUE WHEN t.task_id IS NULL;
            IF it.k = 'create' THEN
                PERFORM set_config('app.tenant_id', it.tenant_id, true);
                PERFORM audit_append(it.tenant_id, 'create', 'working', it.subject, it.client_id, it.issuer,
                                     it.task_id, it.request_id, it.client_address, it.detail);
                IF it.lease_owner IS NULL THEN
                    PERFORM pg_notify('mcp_tasks',
                                      json_build_object('k', 'created', 't', it.tenant_id, 'id', it.task_id)::text);
                END IF;
            ELSIF it.k = 'retrieve' AND t.status IN ('completed', 'failed', 'cancelled') THEN
                PERFORM set_config('app.tenant_id', it.tenant_id, true);
                PERFORM audit_append(it.tenant_id, 'retrieve', t.status::text, it.subject, it.client_id, it.issuer,
                                     it.task_id, it.request_id, it.client_address, NULL);
            END IF;
        END LOOP;
        FOR i IN 1 .. n LOOP
            RETURN NEXT found_tasks[i];
        END LOOP;
    END
    $$;

    -- One runner outcome of a batch.
    CREATE TYPE task_finish_item AS (
        tenant_id text, task_id text, owner text, status task_status, outcome text, payload jsonb,
        status_message text, detail jsonb
    );

    CREATE FUNCTION task_finish_batch(p_items jsonb) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        items task_finish_item[];
        it task_finish_item;
        done_tasks tasks[];
        done tasks;
        n integer;
    BEGIN
        SELECT array_agg(jsonb_populate_record(NULL::task_finish_item, e) ORDER BY o) INTO items
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
        n := coalesce(array_length(items, 1), 0);
        -- Every row first, in the caller's (tenant, subject, task) order, before any counter: an
        -- UPDATE fires the counter trigger at once, and a cancel locks its row before that
        -- requestor's counter. One primary-key lookup each (a join would scan the table).
        FOR i IN 1 .. n LOOP
            PERFORM 1 FROM tasks WHERE tenant_id = items[i].tenant_id AND task_id = items[i].task_id
            FOR NO KEY UPDATE;
        END LOOP;
        FOR i IN 1 .. n LOOP
            it := items[i];
            done := NULL;
            UPDATE tasks
            SET status = it.status, outcome = it.outcome, payload = it.payload, status_message = it.status_message,
                last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
                lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
              AND status IN ('working', 'input_required')
            RETURNING * INTO done;
            done_tasks[i] := done;
        END LOOP;
        FOR i IN 1 .. n LOOP
            done := done_tasks[i];
            CONTINUE WHEN done.task_id IS NULL;
            PERFORM audit_append(done.tenant_id, 'complete', done.status::text, done.subject, done.client_id,
                                 done.issuer, done.task_id, NULL, NULL, items[i].detail);
            PERFORM pg_notify('mcp_tasks', json_build_object(
                'k', 'status', 't', done.tenant_id, 'id', done.task_id, 's', done.session_id)::text);
        END LOOP;
        FOR i IN 1 .. n LOOP
            RETURN NEXT done_tasks[i];
        END LOOP;
    END
    $$;

    -- Counters are locked in code point order everywhere (the service sorts in Python, which
    -- compares code points): the database's collation could order "Bob" and "alice" otherwise.
    CREATE OR REPLACE FUNCTION tasks_count_deleted() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO active_tasks (tenant_id, subject, active)
        SELECT tenant_id, subject, -count(*) FROM old_rows WHERE status IN ('working', 'input_required')
        GROUP BY tenant_id, subject ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
        ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + excluded.active;
        RETURN NULL;
    END
    $$;

    -- The tasks_active gauge counts input_required tasks here (the active total comes from the
    -- counters): a count over every active task's row grew with the tasks running.
    CREATE INDEX tasks_input_required ON tasks (tenant_id) WHERE status = 'input_required';

    REVOKE ALL ON FUNCTION task_batch(jsonb), task_finish_batch(jsonb) FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION task_batch(jsonb) TO mcp_tasks_app;
    GRANT EXECUTE ON FUNCTION task_finish_batch(jsonb) TO mcp_tasks_runner;
    GRANT USAGE ON TYPE task_batch_item TO mcp_tasks_app;
    GRANT USAGE ON TYPE task_finish_item TO mcp_tasks_runner;
    """)


def downgrade() -> None:
    run_script("""
    CREATE OR REPLACE FUNCTION tasks_count_deleted() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO active_tasks (tenant_id, subject, active)
        SELECT tenant_id, subject, -count(*) FROM old_rows WHERE status IN ('working', 'input_required')
        GROUP BY tenant_id, subject ORDER BY tenant_id, subject
        ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + excluded.active;
        RETURN NULL;
    END
    $$;
    DROP INDEX tasks_input_required;
    DROP FUNCTION task_finish_batch(jsonb);
    DROP FUNCTION task_batch(jsonb);
    DROP TYPE task_finish_item;
    DROP TYPE task_batch_item;
    """)
