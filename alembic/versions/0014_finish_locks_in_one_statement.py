"""A finish or hand-back batch locks its rows with one statement, not one per task.

Revision ID: 0014
Revises: 0013

``task_finish_batch`` and ``task_release_batch`` lock every row of the batch before they change
any (migration 0002): in the caller's (tenant, subject, task) order, so two batches, or a batch and
a cancel, never wait on each other in a cycle, and before any counter. They did it with one
``SELECT ... FOR NO KEY UPDATE`` per task, a statement of its own each (the executor started and
ended, the plan checked, a snapshot taken). Now one statement locks them all: for each item, in
the order ``unnest`` gives them, a lateral lookup of its row by primary key, ``FOR NO KEY UPDATE``.
Not a join of the items with ``tasks``: planned while the table is young (a new deployment, a
server whose autovacuum is off) and cached for the connection, a join became a hash join over a
scan of the whole table, run again for every batch as the table grew (``bench/ab.py`` caught it:
0.71 -> 0.95 ms of PostgreSQL per lifecycle). Measured with ``bench/sql_cpu.py`` and ``bench/ab.py``
(issue 15; docs/performance.md, fifteenth pass).

The finish's UPDATE joins the items with ``tasks`` too, and was planned so on a young table (a hash
join over a scan of every task; on a table of a page or two, a scan of it per item): the function
now runs with hash joins, merge joins and sequential scans off, so each item's row is found by key
whatever the table has become since the plan was made. The order
rows are locked in and what each batch then does are unchanged; one difference: one statement
reads one snapshot, so an item's row committed by another transaction while the batch waits on an
earlier one is locked by the UPDATE that follows, not before it (a runner finishes only tasks whose
create committed before it claimed them, so no batch meets such a row).
"""

from service.store.sqlscript import run_script

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

UPGRADE = """
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
    -- cancel locks its row before that requestor's counter. One statement for them all (migration
    -- 0014): each item's row by primary key, locked in the items' order (a lateral lookup per item,
    -- in the order unnest gives them; a join could be planned, and cached, as a scan of the table).
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
ALTER FUNCTION task_finish_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public
    SET enable_hashjoin = off SET enable_mergejoin = off SET enable_seqscan = off;

CREATE OR REPLACE FUNCTION task_release_batch(p_items jsonb) RETURNS SETOF tasks
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
    -- Every row first, in the caller's order, by one statement (as task_finish_batch).
    PERFORM 1 FROM unnest(items) WITH ORDINALITY AS u
    CROSS JOIN LATERAL (SELECT 1 FROM tasks k WHERE k.tenant_id = u.tenant_id AND k.task_id = u.task_id
                        FOR NO KEY UPDATE) l;
    FOR i IN 1 .. n LOOP
        it := items[i];
        t := NULL;
        requeued[i] := false;
        UPDATE tasks
        SET status = 'working', status_message = format('%s (attempt %s)', it.requeue_message, attempts + 1),
            last_updated_at = clock_timestamp(), lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL,
            lease_epoch = lease_epoch + 1
        WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
          AND (it.epoch IS NULL OR lease_epoch = it.epoch)
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
                lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
              AND (it.epoch IS NULL OR lease_epoch = it.epoch)
              AND (it.only_if_lapsed IS NOT TRUE OR lease_lapsed(lease_owner, lease_expires_at))
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
ALTER FUNCTION task_release_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;
"""

DOWNGRADE = """
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

CREATE OR REPLACE FUNCTION task_release_batch(p_items jsonb) RETURNS SETOF tasks
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
            last_updated_at = clock_timestamp(), lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL,
            lease_epoch = lease_epoch + 1
        WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
          AND (it.epoch IS NULL OR lease_epoch = it.epoch)
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
                lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
              AND (it.epoch IS NULL OR lease_epoch = it.epoch)
              AND (it.only_if_lapsed IS NOT TRUE OR lease_lapsed(lease_owner, lease_expires_at))
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
ALTER FUNCTION task_release_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;
"""


def upgrade() -> None:
    run_script(UPGRADE)


def downgrade() -> None:
    run_script(DOWNGRADE)
