"""Gets and retrieves look their task up by primary key alone (issue 15, point 1).

Revision ID: 0007
Revises: 0006

``task_batch`` found a get's or a retrieve's task with ``tenant_id``, ``task_id`` and ``subject`` in
one WHERE. ``tasks_owner_recent`` (tenant_id, subject, created_at DESC, task_id DESC) matches all
three, and without fresh statistics (a new or fast-growing table) the planner costs it level with
the primary key and may take it: it then walks every index entry of the subject to find the one
task. With 6,400 tasks held by one principal that was 0.45 ms of PostgreSQL per get instead of
0.02, and one principal's gets ran at less than half the rate of the same load spread over 32
principals. The lookup is now by the primary key only; the owner and the expiry are checked on
the row, with the same outcome as before (no row: unknown, expired or someone else's).

A create read its requestor's and tenant's active-task counters afresh for every item; a batch of
one busy requestor's creates then read the counter row through the versions its own earlier
inserts had left. They are now read once per run of one requestor's items (the batch is sorted)
and counted on in the function, under the tenant's create lock as before.
"""

from service.store.sqlscript import run_script

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
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
        counted_tenant text;
        counted_subject text;
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
                -- The counters are read once per run of one requestor's creates (the batch is sorted)
                -- and counted on here: the tenant's create lock keeps other creates out, a finish
                -- committed meanwhile only lowers them. One read per batch for a busy requestor, not
                -- one per create through the row versions this batch's own inserts left behind.
                IF counted_tenant IS DISTINCT FROM it.tenant_id OR counted_subject IS DISTINCT FROM it.subject THEN
                    SELECT coalesce(sum(active) FILTER (WHERE subject = it.subject), 0), coalesce(sum(active), 0)
                        INTO mine, total
                    FROM active_tasks WHERE tenant_id = it.tenant_id AND active > 0;
                    counted_tenant := it.tenant_id;
                    counted_subject := it.subject;
                END IF;
                IF mine < it.max_per_requestor AND total < it.max_per_tenant THEN
                    INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool,
                                       arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                       expires_at, lease_owner, lease_key, lease_expires_at, attempts, started_at,
                                       rerunnable, tool_version)
                    VALUES (it.tenant_id, it.task_id, it.subject, it.issuer, it.client_id, it.session_id, it.surface,
                            it.tool, it.arguments, it.client_capabilities, it.progress_token, it.ttl_ms,
                            it.poll_interval_ms, clock_timestamp() + it.ttl_ms * interval '1 millisecond',
                            it.lease_owner, it.lease_key, clock_timestamp() + it.lease_ms * interval '1 millisecond',
                            CASE WHEN it.lease_owner IS NULL THEN 0 ELSE 1 END,
                            CASE WHEN it.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                            it.rerunnable, it.tool_version)
                    RETURNING * INTO t;
                    mine := mine + 1;  -- as the counter trigger just did
                    total := total + 1;
                END IF;
            ELSIF it.k IN ('retrieve', 'get') THEN
                -- Only what a lookup answers with: not the arguments nor the client's capabilities,
                -- which every poll of a running task would otherwise read and send (issue 14 #4). By
                -- primary key alone, then the owner and the expiry checked here: with the subject in
                -- the WHERE the planner may take tasks_owner_recent (tenant, subject, ..., task_id) and
                -- walk every task of the subject (6,400 index entries for one busy principal).
                SELECT tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool, progress_token,
                       status, status_message, outcome, payload, ttl_ms, poll_interval_ms, created_at,
                       last_updated_at, attempts, expires_at
                INTO t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.surface, t.tool,
                     t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
                     t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at
                FROM tasks
                WHERE tenant_id = it.tenant_id AND task_id = it.task_id;
                IF t.task_id IS NOT NULL AND (t.subject <> it.subject OR NOT t.expires_at > clock_timestamp()) THEN
                    t := NULL;
                END IF;
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
""")


def downgrade() -> None:
    run_script("""
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
                                       expires_at, lease_owner, lease_key, lease_expires_at, attempts, started_at,
                                       rerunnable, tool_version)
                    VALUES (it.tenant_id, it.task_id, it.subject, it.issuer, it.client_id, it.session_id, it.surface,
                            it.tool, it.arguments, it.client_capabilities, it.progress_token, it.ttl_ms,
                            it.poll_interval_ms, clock_timestamp() + it.ttl_ms * interval '1 millisecond',
                            it.lease_owner, it.lease_key, clock_timestamp() + it.lease_ms * interval '1 millisecond',
                            CASE WHEN it.lease_owner IS NULL THEN 0 ELSE 1 END,
                            CASE WHEN it.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                            it.rerunnable, it.tool_version)
                    RETURNING * INTO t;
                END IF;
            ELSIF it.k IN ('retrieve', 'get') THEN
                -- Only what a lookup answers with: not the arguments nor the client's capabilities,
                -- which every poll of a running task would otherwise read and send (issue 14 #4).
                SELECT tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool, progress_token,
                       status, status_message, outcome, payload, ttl_ms, poll_interval_ms, created_at,
                       last_updated_at, attempts
                INTO t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.surface, t.tool,
                     t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
                     t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts
                FROM tasks
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
""")
