"""Retention after the end: a started task has no expiry while it works, one that ends or waits
(for input, for a runner) is kept its TTL from then (issue 43). task_create_v2, task_finish_v2 and task_hand_back_v2 beside the
0.1.0 functions, which stay while release 0.1.0 may run beside this one (a trigger gives a task
they end or pause its retention); the service's roles may set a task's expires_at (a claim, a
cancel, a question, an answer).

Revision ID: 0022
Revises: 0021

Append-only: once committed, this file never changes (docs/decisions.md). A changed SQL function
is created here with its full new body; alembic/schema.sql gets the same change.
"""

from service.store.sqlscript import run_script

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    -- ===================================================== hot paths: retention after the end ==
    -- A task's lifetime follows its work (docs/decisions.md, D-12): a task a runner has started has
    -- no expiry while it works ('infinity': nothing running is deleted for its age, the runtime limit
    -- bounds it); one that ends, waits for input or waits for a runner (created or re-queued without
    -- one) is kept its TTL from then (ttl_ms is the retention granted). task_create_v2,
    -- task_finish_v2 and task_hand_back_v2 set expires_at so, and a claim sets 'infinity';
    -- task_create, task_finish and task_hand_back above stay while release 0.1.0 may run beside this
    -- one (CONTRIBUTING.md, "Change a SQL function"), and a later release drops them.
    CREATE FUNCTION task_create_v2(p_items jsonb) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        items task_create_item[];
        it task_create_item;
        found_tasks tasks[];
        lock_tenant text;
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
                                       rerunnable, tool_version)
                    VALUES (it.tenant_id, it.task_id, it.subject, it.issuer, it.client_id, it.session_id, it.wire,
                            it.tool, it.arguments, it.client_capabilities, it.progress_token, it.ttl_ms,
                            it.poll_interval_ms,
                            CASE WHEN it.lease_owner IS NULL THEN clock_timestamp() + it.ttl_ms * interval '1 millisecond'
                                 ELSE 'infinity'::timestamptz END,
                            it.lease_owner, clock_timestamp() + it.lease_ms * interval '1 millisecond',
                            CASE WHEN it.lease_owner IS NULL THEN 0 ELSE 1 END,
                            CASE WHEN it.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                            it.rerunnable, it.tool_version)
                    RETURNING * INTO t;
                    found_tasks[pending_at[1]] := t;
                ELSE
                WITH ins AS (
                    INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool,
                                       arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                       expires_at, lease_owner, lease_expires_at, attempts, started_at,
                                       rerunnable, tool_version)
                    SELECT p.tenant_id, p.task_id, p.subject, p.issuer, p.client_id, p.session_id, p.wire,
                           p.tool, p.arguments, p.client_capabilities, p.progress_token, p.ttl_ms,
                           p.poll_interval_ms,
                           CASE WHEN p.lease_owner IS NULL THEN clock_timestamp() + p.ttl_ms * interval '1 millisecond'
                                ELSE 'infinity'::timestamptz END,
                           p.lease_owner, clock_timestamp() + p.lease_ms * interval '1 millisecond',
                           CASE WHEN p.lease_owner IS NULL THEN 0 ELSE 1 END,
                           CASE WHEN p.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                           p.rerunnable, p.tool_version
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
            END IF;
            EXIT WHEN i > n;
            it := items[i];
            PERFORM set_config('app.tenant_id', it.tenant_id, true);
            -- The counters are read once per run of one requestor's creates (the batch is sorted), plus
            -- this tenant's creates not inserted yet, and counted on here: the tenant's create lock
            -- keeps other creates out, a finish committed meanwhile only lowers them.
            IF counted_tenant IS DISTINCT FROM it.tenant_id OR counted_subject IS DISTINCT FROM it.subject THEN
                SELECT coalesce(sum(active) FILTER (WHERE subject = it.subject), 0), coalesce(sum(active), 0)
                    INTO mine, total
                FROM active_tasks WHERE tenant_id = it.tenant_id AND active > 0;
                total := total + cardinality(pending);
                mine := mine + (SELECT count(*) FROM unnest(pending) p WHERE p.subject = it.subject);
                counted_tenant := it.tenant_id;
                counted_subject := it.subject;
            END IF;
            IF mine < it.max_per_requestor AND total < it.max_per_tenant THEN
                pending_tenant := it.tenant_id;
                pending[cardinality(pending) + 1] := it;
                pending_at[cardinality(pending_at) + 1] := i;
                pending_ids[cardinality(pending_ids) + 1] := it.task_id;
                mine := mine + 1;  -- as the counter trigger will
                total := total + 1;
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

    CREATE FUNCTION task_finish_v2(p_items jsonb) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        items task_finish_item[];
        done_tasks tasks[] := '{}';
        done tasks;
        done_list tasks[];
        done_at bigint[];
        n integer;
        events audit_event_item[] := '{}';
        event_tenants text[] := '{}';
        n_events integer := 0;
    BEGIN
        SELECT array_agg(jsonb_populate_record(NULL::task_finish_item, e) ORDER BY o) INTO items
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
        n := coalesce(array_length(items, 1), 0);
        -- Every row first, in the caller's (tenant, subject, task) order, before any counter: a
        -- cancel locks its row before that requestor's counter. One statement for them all: each
        -- item's row by primary key, locked in the items' order (a lateral lookup per item, in the
        -- order unnest gives them; a join could be planned, and cached, as a scan of the table).
        PERFORM 1 FROM unnest(items) WITH ORDINALITY AS u
        CROSS JOIN LATERAL (SELECT 1 FROM tasks k WHERE k.tenant_id = u.tenant_id AND k.task_id = u.task_id
                            FOR NO KEY UPDATE) l;
        -- Then one UPDATE for them all, each row under its own lease check, so the counter trigger
        -- changes each requestor's counter once for the batch. The rows are locked already: the join
        -- order does not matter. A task named twice is finished once (the first the join meets).
        WITH finished AS (
            UPDATE tasks t
            SET status = u.status, outcome = u.outcome, payload = u.payload, status_message = u.status_message,
                last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
                expires_at = clock_timestamp() + t.ttl_ms * interval '1 millisecond',
                lease_owner = NULL, lease_expires_at = NULL
            FROM unnest(items) WITH ORDINALITY AS u
            WHERE t.tenant_id = u.tenant_id AND t.task_id = u.task_id AND t.lease_owner = u.owner
              AND t.lease_epoch = u.epoch AND task_status_active(t.status)
            RETURNING t AS done_row, u.ordinality AS pos
        )
        SELECT array_agg(f.done_row ORDER BY f.pos), array_agg(f.pos ORDER BY f.pos) INTO done_list, done_at FROM finished f;
        FOR j IN 1 .. coalesce(cardinality(done_at), 0) LOOP
            done_tasks[done_at[j]] := done_list[j];
        END LOOP;
        -- The audit events in item order, appended by one call for all their tenants.
        FOR i IN 1 .. n LOOP
            done := done_tasks[i];
            CONTINUE WHEN done.task_id IS NULL;
            n_events := n_events + 1;
            event_tenants[n_events] := done.tenant_id;
            events[n_events] := ROW('complete', done.status::text, done.subject, done.client_id, done.issuer,
                                    done.task_id, NULL, NULL, items[i].detail)::audit_event_item;
            PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', done.tenant_id,
                                                             'task_id', done.task_id, 'session_id', done.session_id)::text);
        END LOOP;
        IF n_events > 0 THEN
            PERFORM audit_append_events(event_tenants, events);
        END IF;
        FOR i IN 1 .. n LOOP
            RETURN NEXT done_tasks[i];
        END LOOP;
    END
    $$;

    CREATE FUNCTION task_hand_back_v2(p_items jsonb) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        items task_hand_back_item[];
        it task_hand_back_item;
        moved tasks[];
        requeued boolean[];
        t tasks;
        n integer;
        events audit_event_item[] := '{}';
        event_tenants text[] := '{}';
    BEGIN
        SELECT array_agg(jsonb_populate_record(NULL::task_hand_back_item, e) ORDER BY o) INTO items
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
        n := coalesce(array_length(items, 1), 0);
        PERFORM 1 FROM unnest(items) WITH ORDINALITY AS u
        CROSS JOIN LATERAL (SELECT 1 FROM tasks k WHERE k.tenant_id = u.tenant_id AND k.task_id = u.task_id
                            FOR NO KEY UPDATE) l;
        FOR i IN 1 .. n LOOP
            it := items[i];
            t := NULL;
            requeued[i] := false;
            UPDATE tasks
            SET status = 'working', status_message = format('%s (attempt %s)', it.requeue_message, attempts + 1),
                last_updated_at = clock_timestamp(), expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond',
                lease_owner = NULL,
                lease_expires_at = NULL, lease_epoch = lease_epoch + 1
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
              AND lease_epoch = it.epoch
              AND (it.only_if_lapsed IS NOT TRUE OR lease_lapsed(lease_owner, lease_expires_at))
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
                    expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond',
                    lease_owner = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1
                WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
                  AND lease_epoch = it.epoch
                  AND (it.only_if_lapsed IS NOT TRUE OR lease_lapsed(lease_owner, lease_expires_at))
                  AND task_status_active(status)
                RETURNING * INTO t;
            END IF;
            moved[i] := t;
        END LOOP;
        FOR i IN 1 .. n LOOP
            t := moved[i];
            CONTINUE WHEN t.task_id IS NULL;
            event_tenants := event_tenants || t.tenant_id;
            IF requeued[i] THEN
                events := events || ROW('requeue', 'working', t.subject, t.client_id, t.issuer, t.task_id, NULL, NULL,
                                        jsonb_build_object('attempt', t.attempts + 1, 'owner', items[i].owner))::audit_event_item;
                PERFORM pg_notify('mcp_tasks', json_build_object(
                    'v', 1, 'k', 'created', 'tenant_id', t.tenant_id, 'task_id', t.task_id)::text);
            ELSE
                events := events || ROW('complete', 'failed', t.subject, t.client_id, t.issuer, t.task_id, NULL, NULL,
                                        jsonb_build_object('kind', 'failure',
                                                           'reason', items[i].failure ->> 'reason'))::audit_event_item;
            END IF;
            PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', t.tenant_id,
                                                             'task_id', t.task_id, 'session_id', t.session_id)::text);
        END LOOP;
        IF cardinality(events) > 0 THEN
            PERFORM audit_append_events(event_tenants, events);
        END IF;
        FOR i IN 1 .. n LOOP
            RETURN NEXT moved[i];
        END LOOP;
    END
    $$;

    -- Release 0.1.0's statements end or pause a task without setting its expiry: while it runs beside
    -- this release, a task of this release that one of them ends, cancels or makes wait for input
    -- gets its retention from that change here, so that no row is kept forever. This release's own
    -- statements set a finite expiry with any such change, and the trigger's condition skips them.
    CREATE FUNCTION tasks_retention_from_change() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        NEW.expires_at := clock_timestamp() + NEW.ttl_ms * interval '1 millisecond';
        RETURN NEW;
    END
    $$;
    CREATE TRIGGER tasks_retention_from_change BEFORE UPDATE OF status ON tasks
        FOR EACH ROW WHEN (NEW.status <> 'working' AND NEW.expires_at = 'infinity')
        EXECUTE FUNCTION tasks_retention_from_change();

    REVOKE ALL ON FUNCTION task_create_v2(jsonb), task_finish_v2(jsonb), task_hand_back_v2(jsonb) FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION task_create_v2(jsonb) TO mcp_tasks_app;
    GRANT EXECUTE ON FUNCTION task_finish_v2(jsonb), task_hand_back_v2(jsonb) TO mcp_tasks_runner;
    ALTER FUNCTION task_finish_v2(jsonb) OWNER TO mcp_tasks_record;
    ALTER FUNCTION task_finish_v2(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public
        SET enable_hashjoin = off SET enable_mergejoin = off SET enable_seqscan = off;
    ALTER FUNCTION task_hand_back_v2(jsonb) OWNER TO mcp_tasks_record;
    ALTER FUNCTION task_hand_back_v2(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;

    GRANT UPDATE (expires_at) ON tasks TO mcp_tasks_app, mcp_tasks_runner;
    """)


def downgrade() -> None:
    run_script("""
    REVOKE UPDATE (expires_at) ON tasks FROM mcp_tasks_app, mcp_tasks_runner;
    DROP TRIGGER tasks_retention_from_change ON tasks;
    DROP FUNCTION tasks_retention_from_change();
    DROP FUNCTION task_create_v2(jsonb), task_finish_v2(jsonb), task_hand_back_v2(jsonb);
    """)
