"""One implementation per stored operation, wire-neutral outcomes and questions, events by reference.

Revision ID: 0002
Revises: 0001

- ``task_status_active(status)`` is the one definition of "active"; triggers, constraints, the
  partial index and every query use it.
- A stored outcome is wire-neutral: a call that returned a result (with ``isError`` or not) is
  ``completed``, and only a call that failed is ``failed`` with outcome ``failure`` and a reason
  (``rpc_error`` rows are converted). Each wire renders it (2025-11-25 shows a tool error as failed).
- The single-item functions ``task_create``, ``task_get``, ``task_retrieve`` and ``task_finish``
  go: a single request is a batch of one through ``task_batch`` / ``task_finish_batch``, which keep
  their bodies but send their wake-ups in the versioned event form of ``service/store/events.py``.
- ``task_release_batch``: the one hand-back path for a stopping runner and the reaper (re-queue
  when the tool may re-run and attempts remain, else fail), audited (new action ``requeue``).
- ``task_messages`` holds questions as ``(input_key, kind, params)``, wire-neutral.
- ``event_payloads``: events too large for NOTIFY are sent by reference (read under RLS).
"""


from service.store.sqlscript import run_script

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    -- "Active" (working or input_required) is decided here and only here.
    CREATE FUNCTION task_status_active(s task_status) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN s IN ('working', 'input_required');

    -- One stored outcome, rendered per wire: a tool error is a completed call (its result says so),
    -- and only a call that failed is failed. 'rpc_error' becomes 'failure' with a reason.
    ALTER TABLE tasks DROP CONSTRAINT tasks_outcome_matches_status;
    ALTER TABLE tasks DROP CONSTRAINT tasks_lease_only_while_active;
    UPDATE tasks SET status = 'completed' WHERE outcome = 'tool_error';
    UPDATE tasks SET outcome = 'failure', payload = jsonb_build_object('reason', 'tool') || payload
        WHERE outcome = 'rpc_error';
    ALTER TABLE tasks ADD CONSTRAINT tasks_outcome_matches_status CHECK (
           (status = 'completed' AND outcome IN ('result', 'tool_error') AND payload IS NOT NULL)
        OR (status = 'failed' AND outcome = 'failure' AND payload IS NOT NULL)
        OR (status IN ('working', 'input_required', 'cancelled') AND outcome IS NULL AND payload IS NULL)
    );
    ALTER TABLE tasks ADD CONSTRAINT tasks_lease_only_while_active CHECK (
        lease_owner IS NULL OR task_status_active(status)
    );
    DROP INDEX tasks_active_owner;
    CREATE INDEX tasks_active_owner ON tasks (tenant_id, subject) WHERE task_status_active(status);

    -- Re-queues by the reaper or a stopping runner are audited too.
    ALTER TABLE audit_events DROP CONSTRAINT audit_events_action_known;
    ALTER TABLE audit_events ADD CONSTRAINT audit_events_action_known CHECK (action IN
        ('create', 'complete', 'retrieve', 'cancel', 'input', 'expire', 'deny', 'requeue'));

    -- Questions and answers are wire-neutral: a key (unique for the task's life and the tenant), the
    -- kind of question and its own fields; the answer is {"result": ...} or {"error": ...}.
    ALTER TABLE task_messages RENAME COLUMN rpc_id TO input_key;
    ALTER TABLE task_messages RENAME CONSTRAINT task_messages_rpc_id_unique TO task_messages_input_key_unique;
    ALTER TABLE task_messages RENAME COLUMN method TO kind;
    UPDATE task_messages SET kind = CASE kind WHEN 'elicitation/create' THEN 'elicitation'
                                              WHEN 'sampling/createMessage' THEN 'sampling'
                                              WHEN 'roots/list' THEN 'roots' ELSE kind END,
                             params = params - '_meta';
    ALTER TABLE task_messages ADD CONSTRAINT task_messages_kind_known
        CHECK (kind IN ('elicitation', 'sampling', 'roots'));

    -- Events too large for NOTIFY travel by reference (service/store/events.py); kept a minute.
    CREATE TABLE event_payloads (
        tenant_id  text        NOT NULL,
        id         bigint      GENERATED ALWAYS AS IDENTITY,
        payload    jsonb       NOT NULL,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
        CONSTRAINT event_payloads_pkey PRIMARY KEY (tenant_id, id)
    );
    CREATE INDEX event_payloads_age ON event_payloads (created_at);
    GRANT SELECT, INSERT, DELETE ON event_payloads TO mcp_tasks_app, mcp_tasks_runner;
    ALTER TABLE event_payloads ENABLE ROW LEVEL SECURITY;
    ALTER TABLE event_payloads FORCE ROW LEVEL SECURITY;
    CREATE POLICY event_payloads_tenant_isolation ON event_payloads TO mcp_tasks_app
        USING (tenant_id = current_setting('app.tenant_id', true))
        WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
    CREATE POLICY event_payloads_runner_all_tenants ON event_payloads TO mcp_tasks_runner
        USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');

    CREATE OR REPLACE FUNCTION tasks_count_active() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        was_active boolean := false;
        is_active boolean := task_status_active(NEW.status);
    BEGIN
        IF TG_OP = 'UPDATE' THEN
            was_active := task_status_active(OLD.status);
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
    CREATE OR REPLACE FUNCTION tasks_count_deleted() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO active_tasks (tenant_id, subject, active)
        SELECT tenant_id, subject, -count(*) FROM old_rows WHERE task_status_active(status)
        GROUP BY tenant_id, subject ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
        ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + excluded.active;
        RETURN NULL;
    END
    $$;

    -- One implementation per stored operation: a single request is a batch of one.
    DROP FUNCTION task_create(text, text, text, text, text, text, text, text, jsonb, jsonb, jsonb, bigint, integer,
                              bigint, bigint, text, text, jsonb, text, bigint, bigint);
    DROP FUNCTION task_get(text, text, text);
    DROP FUNCTION task_retrieve(text, text, text, text, text, text, text);
    DROP FUNCTION task_finish(text, text, text, task_status, text, jsonb, text, jsonb);

    -- task_batch keeps its items and its work; its wake-ups take the versioned event form.
    CREATE OR REPLACE FUNCTION task_batch(p_items jsonb) RETURNS SETOF tasks
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
                    PERFORM pg_notify('mcp_tasks', json_build_object(
                        'v', 1, 'k', 'created', 'tenant_id', it.tenant_id, 'task_id', it.task_id)::text);
                END IF;
            ELSIF it.k = 'retrieve' AND NOT task_status_active(t.status) THEN
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

    CREATE OR REPLACE FUNCTION task_finish_batch(p_items jsonb) RETURNS SETOF tasks
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
              AND task_status_active(status)
            RETURNING * INTO done;
            done_tasks[i] := done;
        END LOOP;
        FOR i IN 1 .. n LOOP
            done := done_tasks[i];
            CONTINUE WHEN done.task_id IS NULL;
            PERFORM audit_append(done.tenant_id, 'complete', done.status::text, done.subject, done.client_id,
                                 done.issuer, done.task_id, NULL, NULL, items[i].detail);
            PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', done.tenant_id,
                                                             'task_id', done.task_id, 'session_id', done.session_id)::text);
        END LOOP;
        FOR i IN 1 .. n LOOP
            RETURN NEXT done_tasks[i];
        END LOOP;
    END
    $$;

    -- A runner gave a task back (it stopped, or its lease was lost and the reaper found it): run it
    -- again if its tool may re-run and attempts remain, else fail it. The one hand-back path, for
    -- the reaper and a stopping runner alike; rows locked first in the caller's order, as finishes.
    CREATE TYPE task_release_item AS (
        tenant_id text, task_id text, owner text, rerunnable boolean, max_attempts integer,
        requeue_message text, failure jsonb
    );

    CREATE FUNCTION task_release_batch(p_items jsonb) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        items task_release_item[];
        it task_release_item;
        moved tasks[];
        requeued boolean[];
        t tasks;
        n integer;
    BEGIN
        SELECT array_agg(jsonb_populate_record(NULL::task_release_item, e) ORDER BY o) INTO items
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
        n := coalesce(array_length(items, 1), 0);
        FOR i IN 1 .. n LOOP
            PERFORM 1 FROM tasks WHERE tenant_id = items[i].tenant_id AND task_id = items[i].task_id
            FOR NO KEY UPDATE;
        END LOOP;
        FOR i IN 1 .. n LOOP
            it := items[i];
            t := NULL;
            requeued[i] := false;
            UPDATE tasks
            SET status = 'working', status_message = format('%s (attempt %s)', it.requeue_message, attempts + 1),
                last_updated_at = clock_timestamp(), lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
              AND task_status_active(status) AND it.rerunnable AND attempts < it.max_attempts
            RETURNING * INTO t;
            IF t.task_id IS NOT NULL THEN
                requeued[i] := true;
                -- Its questions were asked by the run that stopped: they can no longer be answered.
                DELETE FROM task_messages WHERE tenant_id = it.tenant_id AND task_id = it.task_id
                    AND answered_at IS NULL;
            ELSE
                UPDATE tasks
                SET status = 'failed', outcome = 'failure', payload = it.failure,
                    status_message = it.failure ->> 'message',
                    last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
                    lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
                WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
                  AND task_status_active(status)
                RETURNING * INTO t;
            END IF;
            moved[i] := t;
        END LOOP;
        FOR i IN 1 .. n LOOP
            t := moved[i];
            CONTINUE WHEN t.task_id IS NULL;
            IF requeued[i] THEN
                PERFORM audit_append(t.tenant_id, 'requeue', 'working', t.subject, t.client_id, t.issuer, t.task_id,
                                     NULL, NULL, jsonb_build_object('attempt', t.attempts + 1, 'owner', items[i].owner));
                PERFORM pg_notify('mcp_tasks', json_build_object(
                    'v', 1, 'k', 'created', 'tenant_id', t.tenant_id, 'task_id', t.task_id)::text);
            ELSE
                PERFORM audit_append(t.tenant_id, 'complete', 'failed', t.subject, t.client_id, t.issuer, t.task_id,
                                     NULL, NULL, jsonb_build_object('kind', 'failure',
                                                                    'reason', items[i].failure ->> 'reason'));
            END IF;
            PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', t.tenant_id,
                                                             'task_id', t.task_id, 'session_id', t.session_id)::text);
        END LOOP;
        FOR i IN 1 .. n LOOP
            RETURN NEXT moved[i];
        END LOOP;
    END
    $$;

    REVOKE ALL ON FUNCTION task_release_batch(jsonb) FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION task_release_batch(jsonb) TO mcp_tasks_runner;
    GRANT USAGE ON TYPE task_release_item TO mcp_tasks_runner;
""")


def downgrade() -> None:
    run_script("""
    DROP FUNCTION task_release_batch(jsonb);
    DROP TYPE task_release_item;
    CREATE OR REPLACE FUNCTION task_batch(p_items jsonb) RETURNS SETOF tasks
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
    CREATE OR REPLACE FUNCTION task_finish_batch(p_items jsonb) RETURNS SETOF tasks
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
    CREATE FUNCTION task_get(p_tenant text, p_task_id text, p_subject text) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM set_config('app.tenant_id', p_tenant, true);
        RETURN QUERY SELECT * FROM tasks
            WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject
              AND expires_at > clock_timestamp();
    END
    $$;
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
    CREATE OR REPLACE FUNCTION tasks_count_active() RETURNS trigger
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

    DROP TABLE event_payloads;

    ALTER TABLE task_messages DROP CONSTRAINT task_messages_kind_known;
    UPDATE task_messages SET kind = CASE kind WHEN 'elicitation' THEN 'elicitation/create'
                                              WHEN 'sampling' THEN 'sampling/createMessage'
                                              WHEN 'roots' THEN 'roots/list' ELSE kind END;
    ALTER TABLE task_messages RENAME COLUMN kind TO method;
    ALTER TABLE task_messages RENAME CONSTRAINT task_messages_input_key_unique TO task_messages_rpc_id_unique;
    ALTER TABLE task_messages RENAME COLUMN input_key TO rpc_id;

    -- Rows appended since are append-only: the old rule holds for new rows only.
    ALTER TABLE audit_events DROP CONSTRAINT audit_events_action_known;
    ALTER TABLE audit_events ADD CONSTRAINT audit_events_action_known CHECK (action IN
        ('create', 'complete', 'retrieve', 'cancel', 'input', 'expire', 'deny')) NOT VALID;

    ALTER TABLE tasks DROP CONSTRAINT tasks_outcome_matches_status;
    ALTER TABLE tasks DROP CONSTRAINT tasks_lease_only_while_active;
    DROP INDEX tasks_active_owner;
    UPDATE tasks SET status = 'failed' WHERE outcome = 'tool_error';
    UPDATE tasks SET outcome = 'rpc_error', payload = payload - 'reason' WHERE outcome = 'failure';
    ALTER TABLE tasks ADD CONSTRAINT tasks_outcome_matches_status CHECK (
           (status = 'completed' AND outcome = 'result' AND payload IS NOT NULL)
        OR (status = 'failed' AND outcome IN ('tool_error', 'rpc_error') AND payload IS NOT NULL)
        OR (status IN ('working', 'input_required', 'cancelled') AND outcome IS NULL AND payload IS NULL)
    );
    ALTER TABLE tasks ADD CONSTRAINT tasks_lease_only_while_active CHECK (
        lease_owner IS NULL OR status IN ('working', 'input_required')
    );
    CREATE INDEX tasks_active_owner ON tasks (tenant_id, subject)
        WHERE status IN ('working', 'input_required');
    DROP FUNCTION task_status_active(task_status);
""")
