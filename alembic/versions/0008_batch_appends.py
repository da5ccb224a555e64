"""The audit chain appended once per tenant of a batch, the counters changed once per requestor (issue 15, point 2).

Revision ID: 0008
Revises: 0007

A batch of 32 creates of one requestor updated the tenant's audit head 32 times and the
requestor's active_tasks row 32 times in one transaction, each update a new row version that the
next lookup of that row walked through; one busy principal's lifecycles ran at 0.83-0.90x the rate
of the same load spread over many principals, and the audit append was a third of a create's
PostgreSQL CPU.

- ``audit_append_many(tenant, events)`` (SECURITY DEFINER, owned by mcp_tasks_record, the same
  tenant check as ``audit_append``) appends one tenant's events of a batch in order: each event's
  seq, time and hash exactly as ``audit_append`` computes them (``audit_canonical`` unchanged), the
  head locked, read and written once, the rows inserted by one statement. ``task_batch`` and
  ``task_finish_batch`` call it once per tenant, in tenant order (heads after counters, as before).
- The retrieve interval (once per requestor per interval, repeats counted into the next event as
  ``repeats_before``) is ``audit_retrieval_due``, shared by both appends: the requestor's row is
  locked and decides; only a first hand-out locks the task's key and inserts. Two statements where
  there were four; the outcome is the same.
- The counters are kept by statement triggers with transition tables (inserts, updates; deletes
  had one): each statement changes a requestor's counter once. ``task_batch`` inserts a tenant's
  creates with one INSERT (its caps count the ones not inserted yet), ``task_finish_batch``
  finishes its tasks with one UPDATE (each row under its own lease check, the rows locked first
  as before). The update trigger fires for every UPDATE (a trigger with transition tables cannot
  name columns); rows whose activity did not change cancel out and nothing is written.
"""

from service.store.sqlscript import run_script

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    CREATE FUNCTION audit_retrieval_due(p_tenant text, p_task_id text, p_subject text) RETURNS bigint
    LANGUAGE plpgsql AS $$
    DECLARE
        every_s double precision :=
            coalesce(nullif(current_setting('mcp_tasks.audit_retrieve_interval_s', true), ''), '3600')::double precision;
        seen audit_retrievals;
    BEGIN
        IF every_s <= 0 THEN
            RETURN 0;
        END IF;
        SELECT * INTO seen FROM audit_retrievals
        WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject FOR UPDATE;
        IF NOT FOUND THEN
            PERFORM 1 FROM tasks WHERE tenant_id = p_tenant AND task_id = p_task_id FOR KEY SHARE;
            IF NOT FOUND THEN  -- the task is gone: recorded, and nothing to remember it by
                RETURN 0;
            END IF;
            INSERT INTO audit_retrievals (tenant_id, task_id, subject, audited_at, repeats)
            VALUES (p_tenant, p_task_id, p_subject, clock_timestamp(), 0)
            ON CONFLICT (tenant_id, task_id, subject) DO NOTHING;
            IF FOUND THEN
                RETURN 0;
            END IF;
            -- Another transaction's first hand-out inserted it meanwhile: its row decides.
            SELECT * INTO seen FROM audit_retrievals
            WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject FOR UPDATE;
        END IF;
        IF seen.audited_at > clock_timestamp() - every_s * interval '1 second' THEN
            UPDATE audit_retrievals SET repeats = repeats + 1
            WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject;
            RETURN NULL;
        END IF;
        UPDATE audit_retrievals SET audited_at = clock_timestamp(), repeats = 0
        WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject;
        RETURN seen.repeats;
    END
    $$;
    ALTER FUNCTION audit_retrieval_due(text, text, text) OWNER TO mcp_tasks_record;

    CREATE OR REPLACE FUNCTION audit_append(
        p_tenant text, p_action text, p_outcome text, p_subject text, p_client_id text, p_issuer text,
        p_task_id text, p_request_id text, p_client_address text, p_detail jsonb
    ) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
    DECLARE
        head audit_heads;
        e audit_events;
        repeats bigint;
    BEGIN
        -- Row-level security held the request role to its tenant; this function runs as its owner.
        IF current_setting('role') = 'mcp_tasks_app' AND p_tenant IS DISTINCT FROM current_setting('app.tenant_id', true) THEN
            RAISE EXCEPTION 'audit_append: % is not the transaction''s tenant', p_tenant
                USING ERRCODE = 'insufficient_privilege';
        END IF;
        IF p_action = 'retrieve' AND p_task_id IS NOT NULL THEN
            repeats := audit_retrieval_due(p_tenant, p_task_id, coalesce(p_subject, ''));
            IF repeats IS NULL THEN
                RETURN NULL;
            END IF;
            IF repeats > 0 THEN
                p_detail := coalesce(p_detail, '{}') || jsonb_build_object('repeats_before', repeats);
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

    CREATE TYPE audit_event_item AS (
        action text, outcome text, subject text, client_id text, issuer text, task_id text,
        request_id text, client_address text, detail jsonb
    );

    -- Append a batch's events of one tenant, in order, as audit_append would one by one (the same
    -- checks, retrieve interval, seq, time and hash), with the head locked, read and written once and
    -- the rows inserted by one statement: a batch of one busy tenant updated its head row once per
    -- event, and each lookup walked the versions the batch had left (issue 15, point 2).
    CREATE FUNCTION audit_append_many(p_tenant text, p_events audit_event_item[]) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
    DECLARE
        head audit_heads;
        ev audit_event_item;
        kept audit_event_item[] := '{}';
        e audit_events;
        chain audit_events[] := '{}';
        repeats bigint;
        n integer := 0;
    BEGIN
        IF current_setting('role') = 'mcp_tasks_app' AND p_tenant IS DISTINCT FROM current_setting('app.tenant_id', true) THEN
            RAISE EXCEPTION 'audit_append_many: % is not the transaction''s tenant', p_tenant
                USING ERRCODE = 'insufficient_privilege';
        END IF;
        -- The retrieve intervals first, as audit_append decides them before it locks the head.
        FOREACH ev IN ARRAY coalesce(p_events, '{}') LOOP
            ev.subject := coalesce(ev.subject, '');
            IF ev.action = 'retrieve' AND ev.task_id IS NOT NULL THEN
                repeats := audit_retrieval_due(p_tenant, ev.task_id, ev.subject);
                CONTINUE WHEN repeats IS NULL;
                IF repeats > 0 THEN
                    ev.detail := coalesce(ev.detail, '{}') || jsonb_build_object('repeats_before', repeats);
                END IF;
            END IF;
            n := n + 1;
            kept[n] := ev;
        END LOOP;
        IF n = 0 THEN
            RETURN NULL;
        END IF;
        SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
        IF NOT FOUND THEN  -- the tenant's first event
            INSERT INTO audit_heads (tenant_id, seq, hash) VALUES (p_tenant, 0, decode(repeat('00', 32), 'hex'))
                ON CONFLICT (tenant_id) DO NOTHING;
            SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
        END IF;
        e.tenant_id := p_tenant; e.seq := head.seq; e.hash := head.hash; e.at := head.at;
        FOR i IN 1 .. n LOOP
            ev := kept[i];
            e.seq := e.seq + 1; e.at := greatest(clock_timestamp(), e.at);
            e.action := ev.action; e.outcome := ev.outcome;
            e.subject := ev.subject; e.client_id := coalesce(ev.client_id, '');
            e.issuer := coalesce(ev.issuer, ''); e.task_id := ev.task_id; e.request_id := ev.request_id;
            e.client_address := ev.client_address; e.detail := ev.detail; e.prev_hash := e.hash;
            e.hash := sha256(e.prev_hash || convert_to(audit_canonical(e), 'UTF8'));
            chain[i] := e;
        END LOOP;
        IF n = 1 THEN  -- a batch's only event of this tenant: inserted as audit_append does (cheaper)
            INSERT INTO audit_events VALUES (e.*);
        ELSE
            INSERT INTO audit_events SELECT * FROM unnest(chain);
        END IF;
        UPDATE audit_heads SET seq = e.seq, hash = e.hash, at = e.at WHERE tenant_id = p_tenant;
        RETURN e.seq;
    END
    $$;
    ALTER FUNCTION audit_append_many(text, audit_event_item[]) OWNER TO mcp_tasks_record;
    REVOKE ALL ON FUNCTION audit_append_many(text, audit_event_item[]), audit_retrieval_due(text, text, text) FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION audit_append_many(text, audit_event_item[]) TO mcp_tasks_app, mcp_tasks_runner;
    GRANT USAGE ON TYPE audit_event_item TO mcp_tasks_app, mcp_tasks_runner;

    -- The counters: statement triggers for inserts and updates (deletes had one already).
    DROP TRIGGER tasks_count_active ON tasks;
    DROP FUNCTION tasks_count_active();
    CREATE FUNCTION tasks_count_inserted() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO active_tasks (tenant_id, subject, active)
        SELECT tenant_id, subject, count(*) FROM new_rows WHERE task_status_active(status)
        GROUP BY tenant_id, subject ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
        ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + excluded.active;
        RETURN NULL;
    END
    $$;
    CREATE FUNCTION tasks_count_updated() RETURNS trigger
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
    CREATE TRIGGER tasks_count_inserted AFTER INSERT ON tasks REFERENCING NEW TABLE AS new_rows
        FOR EACH STATEMENT EXECUTE FUNCTION tasks_count_inserted();
    CREATE TRIGGER tasks_count_updated AFTER UPDATE ON tasks REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
        FOR EACH STATEMENT EXECUTE FUNCTION tasks_count_updated();

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
        -- The current tenant's creates that passed the caps, not inserted yet, and their places.
        pending task_batch_item[] := '{}';
        pending_at integer[] := '{}';
        pending_ids text[] := '{}';
        pending_tenant text;
        inserted tasks[];
        -- The audit events in item order, and the tenant of each.
        events audit_event_item[] := '{}';
        event_tenants text[] := '{}';
        n_events integer := 0;
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
        -- The rows, in the caller's (tenant, subject, task) order. A tenant's creates go in as one
        -- INSERT when the next tenant's first create comes (or the items end: the extra pass), so the
        -- counter trigger (a statement trigger) changes each requestor's counter once, not once per
        -- task. Row-level security checks every row against the tenant set for the INSERT: its own.
        FOR i IN 1 .. n + 1 LOOP
            IF cardinality(pending) > 0 AND (i > n OR (items[i].k = 'create' AND items[i].tenant_id IS DISTINCT FROM pending_tenant)) THEN
                PERFORM set_config('app.tenant_id', pending_tenant, true);
                IF cardinality(pending) = 1 THEN  -- one create of this tenant: a plain INSERT costs less
                    it := pending[1];
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
                    found_tasks[pending_at[1]] := t;
                ELSE
                WITH ins AS (
                    INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool,
                                       arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                       expires_at, lease_owner, lease_key, lease_expires_at, attempts, started_at,
                                       rerunnable, tool_version)
                    SELECT p.tenant_id, p.task_id, p.subject, p.issuer, p.client_id, p.session_id, p.surface,
                           p.tool, p.arguments, p.client_capabilities, p.progress_token, p.ttl_ms,
                           p.poll_interval_ms, clock_timestamp() + p.ttl_ms * interval '1 millisecond',
                           p.lease_owner, p.lease_key, clock_timestamp() + p.lease_ms * interval '1 millisecond',
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
            t := NULL;
            PERFORM set_config('app.tenant_id', it.tenant_id, true);
            IF it.k = 'create' THEN
                -- The counters are read once per run of one requestor's creates (the batch is sorted),
                -- plus this tenant's creates not inserted yet, and counted on here: the tenant's create
                -- lock keeps other creates out, a finish committed meanwhile only lowers them.
                IF counted_tenant IS DISTINCT FROM it.tenant_id OR counted_subject IS DISTINCT FROM it.subject THEN
                    SELECT coalesce(sum(active) FILTER (WHERE subject = it.subject), 0), coalesce(sum(active), 0)
                        INTO mine, total
                    FROM active_tasks WHERE tenant_id = it.tenant_id AND active > 0;
                    total := total + cardinality(pending);
                    FOR j IN 1 .. cardinality(pending) LOOP
                        IF pending[j].subject = it.subject THEN
                            mine := mine + 1;
                        END IF;
                    END LOOP;
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
        -- Then the audit events: collected in item order, appended once per tenant in tenant order
        -- (audit heads after counters, as every writer).
        FOR i IN 1 .. n LOOP
            it := items[i];
            t := found_tasks[i];
            CONTINUE WHEN t.task_id IS NULL;
            IF it.k = 'create' THEN
                n_events := n_events + 1;
                event_tenants[n_events] := it.tenant_id;
                events[n_events] := ROW('create', 'working', it.subject, it.client_id, it.issuer, it.task_id,
                                        it.request_id, it.client_address, it.detail)::audit_event_item;
                IF it.lease_owner IS NULL THEN
                    PERFORM pg_notify('mcp_tasks', json_build_object(
                        'v', 1, 'k', 'created', 'tenant_id', it.tenant_id, 'task_id', it.task_id)::text);
                END IF;
            ELSIF it.k = 'retrieve' AND NOT task_status_active(t.status) THEN
                n_events := n_events + 1;
                event_tenants[n_events] := it.tenant_id;
                events[n_events] := ROW('retrieve', t.status::text, it.subject, it.client_id, it.issuer, it.task_id,
                                        it.request_id, it.client_address, NULL)::audit_event_item;
            END IF;
        END LOOP;
        FOR lock_tenant IN SELECT DISTINCT x.tenant COLLATE "C" FROM unnest(event_tenants) AS x(tenant) ORDER BY 1 LOOP
            PERFORM set_config('app.tenant_id', lock_tenant, true);
            PERFORM audit_append_many(lock_tenant, ARRAY(
                SELECT events[x.o] FROM unnest(event_tenants) WITH ORDINALITY AS x(tenant, o)
                WHERE x.tenant = lock_tenant ORDER BY x.o));
        END LOOP;
        FOR i IN 1 .. n LOOP
            RETURN NEXT found_tasks[i];
        END LOOP;
    END
    $$;

    -- CREATE OR REPLACE resets what ALTER set in migration 0005 (the owner stays): restated.
    CREATE OR REPLACE FUNCTION task_finish_batch(p_items jsonb) RETURNS SETOF tasks
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
        audit_tenant text;
    BEGIN
        SELECT array_agg(jsonb_populate_record(NULL::task_finish_item, e) ORDER BY o) INTO items
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
        n := coalesce(array_length(items, 1), 0);
        -- Every row first, in the caller's (tenant, subject, task) order, before any counter: a
        -- cancel locks its row before that requestor's counter. One primary-key lookup each.
        FOR i IN 1 .. n LOOP
            PERFORM 1 FROM tasks WHERE tenant_id = items[i].tenant_id AND task_id = items[i].task_id
            FOR NO KEY UPDATE;
        END LOOP;
        -- Then one UPDATE for them all, each row under its own lease check, so the counter trigger
        -- changes each requestor's counter once for the batch. The rows are locked already: the join
        -- order does not matter. A task named twice is finished once (the first the join meets).
        WITH finished AS (
            UPDATE tasks t
            SET status = u.status, outcome = u.outcome, payload = u.payload, status_message = u.status_message,
                last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
                lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
            FROM unnest(items) WITH ORDINALITY AS u
            WHERE t.tenant_id = u.tenant_id AND t.task_id = u.task_id AND t.lease_owner = u.owner
              AND (u.epoch IS NULL OR t.lease_epoch = u.epoch) AND task_status_active(t.status)
            RETURNING t AS done_row, u.ordinality AS pos
        )
        SELECT array_agg(f.done_row ORDER BY f.pos), array_agg(f.pos ORDER BY f.pos) INTO done_list, done_at FROM finished f;
        FOR j IN 1 .. coalesce(cardinality(done_at), 0) LOOP
            done_tasks[done_at[j]] := done_list[j];
        END LOOP;
        -- The audit events in item order, appended once per tenant in tenant order.
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
        FOR audit_tenant IN SELECT DISTINCT x.tenant COLLATE "C" FROM unnest(event_tenants) AS x(tenant) ORDER BY 1 LOOP
            PERFORM audit_append_many(audit_tenant, ARRAY(
                SELECT events[x.o] FROM unnest(event_tenants) WITH ORDINALITY AS x(tenant, o)
                WHERE x.tenant = audit_tenant ORDER BY x.o));
        END LOOP;
        FOR i IN 1 .. n LOOP
            RETURN NEXT done_tasks[i];
        END LOOP;
    END
    $$;
    ALTER FUNCTION task_finish_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;
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
              AND (it.epoch IS NULL OR lease_epoch = it.epoch) AND task_status_active(status)
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
    ALTER FUNCTION task_finish_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;

    DROP TRIGGER tasks_count_inserted ON tasks;
    DROP TRIGGER tasks_count_updated ON tasks;
    DROP FUNCTION tasks_count_inserted();
    DROP FUNCTION tasks_count_updated();
    CREATE FUNCTION tasks_count_active() RETURNS trigger
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
    CREATE TRIGGER tasks_count_active AFTER INSERT OR UPDATE OF status ON tasks
        FOR EACH ROW EXECUTE FUNCTION tasks_count_active();

    DROP FUNCTION audit_append_many(text, audit_event_item[]);
    DROP TYPE audit_event_item;
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
        -- repeats counted into the next event (migration 0003, docs/decisions.md).
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
    DROP FUNCTION audit_retrieval_due(text, text, text);
""")
