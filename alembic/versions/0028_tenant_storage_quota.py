"""The tenant's storage quota (issue 42, point 6): tasks.stored_bytes (what a task's row keeps of
what its client chose, and its result), summed per requestor in active_tasks.bytes by the counters'
triggers; task_create_v3 refuses a create that would take its tenant past max_tenant_bytes. And
tasks.trace_parent, the creating request's trace context (issue 44), which task_create_v3 writes.

Revision ID: 0028
Revises: 0027

Append-only: once committed, this file never changes (docs/decisions.md). A changed SQL function
is created here with its full new body; alembic/schema.sql gets the same change.
"""

from service.store.sqlscript import run_script

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    -- ======================================================== the tenant's storage quota ==
    -- What a tenant makes the service keep (issue 42, point 6): each task row's stored_bytes is the
    -- size of what the client chose (arguments, capabilities, progress token) and of its result, set by
    -- task_create_v3 and by the trigger below whenever a result is written (by any release's
    -- statement); the counters' triggers sum it per requestor beside the active count, so the quota is
    -- read from the same rows as the caps. Rows of tasks created before this revision count 0 until
    -- they are deleted (they were never counted). Status messages (at most 500 characters), questions
    -- and answers and upstream notes (at most 16 KiB) are bounded per task, not counted.
    ALTER TABLE tasks ADD COLUMN stored_bytes bigint NOT NULL DEFAULT 0;
    ALTER TABLE tasks ADD CONSTRAINT tasks_stored_bytes_nonnegative CHECK (stored_bytes >= 0);
    ALTER TABLE active_tasks ADD COLUMN bytes bigint NOT NULL DEFAULT 0;
    ALTER TYPE task_create_item ADD ATTRIBUTE max_tenant_bytes bigint;
    -- The creating request's W3C traceparent (issue 44, tracing): a task's run, in whichever process,
    -- is a child of the request that created it, and later requests link to it. NULL: not traced.
    ALTER TABLE tasks ADD COLUMN trace_parent text;
    ALTER TABLE tasks ADD CONSTRAINT tasks_trace_parent_short CHECK (octet_length(trace_parent) <= 128);
    ALTER TYPE task_create_item ADD ATTRIBUTE trace_parent text;

    CREATE FUNCTION tasks_size_payload() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        NEW.stored_bytes := greatest(OLD.stored_bytes + coalesce(pg_column_size(NEW.payload), 0)
                                     - coalesce(pg_column_size(OLD.payload), 0), 0);
        RETURN NEW;
    END
    $$;
    CREATE TRIGGER tasks_size_payload BEFORE UPDATE OF payload ON tasks
        FOR EACH ROW WHEN (OLD.payload IS DISTINCT FROM NEW.payload)
        EXECUTE FUNCTION tasks_size_payload();

    -- The counters' triggers with the bytes beside the active count (the same rows, the same order).
    CREATE OR REPLACE FUNCTION tasks_count_inserted() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO active_tasks (tenant_id, subject, active, bytes)
        SELECT tenant_id, subject, count(*) FILTER (WHERE task_status_active(status)), sum(stored_bytes)
        FROM new_rows
        GROUP BY tenant_id, subject
        HAVING count(*) FILTER (WHERE task_status_active(status)) <> 0 OR sum(stored_bytes) <> 0
        ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
        ON CONFLICT (tenant_id, subject) DO UPDATE
            SET active = active_tasks.active + excluded.active, bytes = active_tasks.bytes + excluded.bytes;
        RETURN NULL;
    END
    $$;
    CREATE OR REPLACE FUNCTION tasks_count_updated() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO active_tasks (tenant_id, subject, active, bytes)
        SELECT tenant_id, subject, sum(d), sum(b) FROM (
            SELECT tenant_id, subject, CASE WHEN task_status_active(status) THEN 1 ELSE 0 END AS d,
                   stored_bytes AS b
            FROM new_rows
            UNION ALL
            SELECT tenant_id, subject, CASE WHEN task_status_active(status) THEN -1 ELSE 0 END AS d,
                   -stored_bytes AS b
            FROM old_rows
        ) changed
        GROUP BY tenant_id, subject HAVING sum(d) <> 0 OR sum(b) <> 0
        ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
        ON CONFLICT (tenant_id, subject) DO UPDATE
            SET active = active_tasks.active + excluded.active, bytes = active_tasks.bytes + excluded.bytes;
        RETURN NULL;
    END
    $$;
    CREATE OR REPLACE FUNCTION tasks_count_deleted() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO active_tasks (tenant_id, subject, active, bytes)
        SELECT tenant_id, subject, -count(*) FILTER (WHERE task_status_active(status)), -sum(stored_bytes)
        FROM old_rows
        GROUP BY tenant_id, subject
        HAVING count(*) FILTER (WHERE task_status_active(status)) <> 0 OR sum(stored_bytes) <> 0
        ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
        ON CONFLICT (tenant_id, subject) DO UPDATE
            SET active = active_tasks.active + excluded.active, bytes = active_tasks.bytes + excluded.bytes;
        RETURN NULL;
    END
    $$;

    -- Creates checked against the tenant's storage quota too (max_tenant_bytes; NULL: none), with
    -- each row's stored_bytes set. task_create_v2 stays while the previous release may run beside
    -- this one.
    CREATE FUNCTION task_create_v3(p_items jsonb) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        items task_create_item[];
        it task_create_item;
        found_tasks tasks[];
        lock_tenant text;
        held bigint;
        size bigint;
        pending_bytes bigint := 0;
        mine bigint;
        total bigint;
        counted_tenant text;
        counted_subject text;
        n integer;
        -- The current tenant's creates that passed the caps, not inserted yet, and their places.
        pending task_create_item[] := '{}';
        pending_at integer[] := '{}';
        pending_ids text[] := '{}';
        pending_tenant text;
        t tasks;
        inserted tasks[];
    BEGIN
        SELECT array_agg(jsonb_populate_record(NULL::task_create_item, e) ORDER BY o) INTO items
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
        n := coalesce(array_length(items, 1), 0);
        -- The create locks of every tenant of the batch, in tenant order, held until commit.
        FOR lock_tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
            PERFORM pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || lock_tenant, 0));
        END LOOP;
        -- The rows, in the caller's (tenant, subject, task) order. A tenant's creates go in as one
        -- INSERT when the next tenant's first create comes (or the items end: the extra pass), so the
        -- counter trigger (a statement trigger) changes each requestor's counter once, not once per
        -- task. Row-level security checks every row against the tenant set for the INSERT: its own.
        FOR i IN 1 .. n + 1 LOOP
            IF cardinality(pending) > 0 AND (i > n OR items[i].tenant_id IS DISTINCT FROM pending_tenant) THEN
                PERFORM set_config('app.tenant_id', pending_tenant, true);
                IF cardinality(pending) = 1 THEN  -- one create of this tenant: a plain INSERT costs less
                    it := pending[1];
                    INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool,
                                       arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                       expires_at, lease_owner, lease_expires_at, attempts, started_at,
                                       rerunnable, tool_version, stored_bytes, trace_parent)
                    VALUES (it.tenant_id, it.task_id, it.subject, it.issuer, it.client_id, it.session_id, it.wire,
                            it.tool, it.arguments, it.client_capabilities, it.progress_token, it.ttl_ms,
                            it.poll_interval_ms,
                            CASE WHEN it.lease_owner IS NULL THEN clock_timestamp() + it.ttl_ms * interval '1 millisecond'
                                 ELSE 'infinity'::timestamptz END,
                            it.lease_owner, clock_timestamp() + it.lease_ms * interval '1 millisecond',
                            CASE WHEN it.lease_owner IS NULL THEN 0 ELSE 1 END,
                            CASE WHEN it.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                            it.rerunnable, it.tool_version,
                            pg_column_size(it.arguments) + coalesce(pg_column_size(it.client_capabilities), 0)
                            + coalesce(pg_column_size(it.progress_token), 0), it.trace_parent)
                    RETURNING * INTO t;
                    found_tasks[pending_at[1]] := t;
                ELSE
                WITH ins AS (
                    INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool,
                                       arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                       expires_at, lease_owner, lease_expires_at, attempts, started_at,
                                       rerunnable, tool_version, stored_bytes, trace_parent)
                    SELECT p.tenant_id, p.task_id, p.subject, p.issuer, p.client_id, p.session_id, p.wire,
                           p.tool, p.arguments, p.client_capabilities, p.progress_token, p.ttl_ms,
                           p.poll_interval_ms,
                           CASE WHEN p.lease_owner IS NULL THEN clock_timestamp() + p.ttl_ms * interval '1 millisecond'
                                ELSE 'infinity'::timestamptz END,
                           p.lease_owner, clock_timestamp() + p.lease_ms * interval '1 millisecond',
                           CASE WHEN p.lease_owner IS NULL THEN 0 ELSE 1 END,
                           CASE WHEN p.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                           p.rerunnable, p.tool_version,
                           pg_column_size(p.arguments) + coalesce(pg_column_size(p.client_capabilities), 0)
                           + coalesce(pg_column_size(p.progress_token), 0), p.trace_parent
                    FROM unnest(pending) p
                    RETURNING *
                )
                SELECT array_agg(ROW(ins.*)::tasks ORDER BY w.o) INTO inserted
                FROM ins JOIN unnest(pending_ids) WITH ORDINALITY AS w(task_id, o) ON w.task_id = ins.task_id;
                FOR j IN 1 .. cardinality(pending_at) LOOP
                    found_tasks[pending_at[j]] := inserted[j];
                END LOOP;
                END IF;
                pending := '{}';
                pending_at := '{}';
                pending_ids := '{}';
                pending_bytes := 0;
            END IF;
            EXIT WHEN i > n;
            it := items[i];
            PERFORM set_config('app.tenant_id', it.tenant_id, true);
            -- The counters are read once per run of one requestor's creates (the batch is sorted), plus
            -- this tenant's creates not inserted yet, and counted on here: the tenant's create lock
            -- keeps other creates out, a finish committed meanwhile only lowers the active counts (and
            -- adds its result's bytes: the quota admits creates, a result is never refused).
            IF counted_tenant IS DISTINCT FROM it.tenant_id OR counted_subject IS DISTINCT FROM it.subject THEN
                SELECT coalesce(sum(active) FILTER (WHERE subject = it.subject AND active > 0), 0),
                       coalesce(sum(active) FILTER (WHERE active > 0), 0), greatest(coalesce(sum(bytes), 0), 0)
                    INTO mine, total, held
                FROM active_tasks WHERE tenant_id = it.tenant_id;
                total := total + cardinality(pending);
                held := held + pending_bytes;
                mine := mine + (SELECT count(*) FROM unnest(pending) p WHERE p.subject = it.subject);
                counted_tenant := it.tenant_id;
                counted_subject := it.subject;
            END IF;
            -- The bytes the row will hold (stored_bytes): what the tenant's storage quota counts.
            size := pg_column_size(it.arguments) + coalesce(pg_column_size(it.client_capabilities), 0)
                    + coalesce(pg_column_size(it.progress_token), 0);
            IF mine < it.max_per_requestor AND total < it.max_per_tenant
               AND (it.max_tenant_bytes IS NULL OR held + size <= it.max_tenant_bytes) THEN
                pending_tenant := it.tenant_id;
                pending[cardinality(pending) + 1] := it;
                pending_at[cardinality(pending_at) + 1] := i;
                pending_ids[cardinality(pending_ids) + 1] := it.task_id;
                mine := mine + 1;  -- as the counter trigger will
                total := total + 1;
                held := held + size;
                pending_bytes := pending_bytes + size;
            END IF;
        END LOOP;
        -- Then the audit events, appended per tenant in tenant order (audit heads after counters, as
        -- every writer), under that tenant; the unleased tasks announced.
        FOR lock_tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
            PERFORM set_config('app.tenant_id', lock_tenant, true);
            PERFORM audit_append_events(array_agg(lock_tenant), array_agg(
                        ROW('create', 'working', x.subject, x.client_id, x.issuer, x.task_id, x.request_id,
                            x.client_address, x.detail)::audit_event_item ORDER BY x.ordinality))
            FROM unnest(items) WITH ORDINALITY AS x
            WHERE x.tenant_id = lock_tenant AND (found_tasks[x.ordinality]).task_id IS NOT NULL
            HAVING count(*) > 0;
        END LOOP;
        FOR i IN 1 .. n LOOP
            IF (found_tasks[i]).task_id IS NOT NULL AND items[i].lease_owner IS NULL THEN
                PERFORM pg_notify('mcp_tasks', json_build_object(
                    'v', 1, 'k', 'created', 'tenant_id', items[i].tenant_id, 'task_id', items[i].task_id)::text);
            END IF;
            RETURN NEXT found_tasks[i];
        END LOOP;
    END
    $$;

    REVOKE ALL ON FUNCTION task_create_v3(jsonb) FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION task_create_v3(jsonb) TO mcp_tasks_app;
    """)


def downgrade() -> None:
    run_script("""
    DROP FUNCTION task_create_v3(jsonb);
    CREATE OR REPLACE FUNCTION tasks_count_inserted() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO active_tasks (tenant_id, subject, active)
        SELECT tenant_id, subject, count(*) FROM new_rows WHERE task_status_active(status)
        GROUP BY tenant_id, subject ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
        ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + excluded.active;
        RETURN NULL;
    END
    $$;
    -- A trigger with transition tables cannot name columns, so this one fires for every UPDATE (a
    -- lease renewal too): the rows whose activity did not change cancel out and nothing is written.
    -- Old and new rows are summed apart, so even a requestor that changed would be counted right.
    CREATE OR REPLACE FUNCTION tasks_count_updated() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO active_tasks (tenant_id, subject, active)
        SELECT tenant_id, subject, sum(d) FROM (
            SELECT tenant_id, subject, 1 AS d FROM new_rows WHERE task_status_active(status)
            UNION ALL
            SELECT tenant_id, subject, -1 AS d FROM old_rows WHERE task_status_active(status)
        ) changed
        GROUP BY tenant_id, subject HAVING sum(d) <> 0
        ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
        ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + excluded.active;
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
    DROP TRIGGER tasks_size_payload ON tasks;
    DROP FUNCTION tasks_size_payload();
    ALTER TYPE task_create_item DROP ATTRIBUTE trace_parent;
    ALTER TABLE tasks DROP COLUMN trace_parent;
    ALTER TYPE task_create_item DROP ATTRIBUTE max_tenant_bytes;
    ALTER TABLE active_tasks DROP COLUMN bytes;
    ALTER TABLE tasks DROP COLUMN stored_bytes;
    """)
