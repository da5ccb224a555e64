"""A finish batch skips a task row locked elsewhere instead of waiting for it.

Revision ID: 0013
Revises: 0012

``task_finish_batch`` locked each task row of a batch of outcomes, waiting for any held
elsewhere. The runner's connections have no lock timeout, so one row locked by a transaction
left open (an operator's psql, a stuck client) held that statement, and with it every outcome
queued behind it in the runner's lane, of every tenant, for as long as the lock stayed.

``task_finish_batch_nowait`` is the same function with the rows locked ``SKIP LOCKED``: a row
locked elsewhere is not written and its item answers NULL, as a refused one does; the runner
reads the task's lease, finds it still its own and active, and writes the outcome again a
moment later (docs/decisions.md, "A finish never waits for a task row"). Everything else is
unchanged: the lease check, the audit events and the wake-ups of the rows it did lock.

``task_finish_batch`` stays for the previous release's runners during a rolling upgrade: it
waits for each row as before, then calls the new function, to which rows its own transaction
locked are not locked elsewhere. Drop it in a later release.
"""

from service.store.sqlscript import run_script

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

NOWAIT = """
CREATE FUNCTION task_finish_batch_nowait(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_finish_item[];
    done_tasks tasks[] := '{}';
    done tasks;
    done_list tasks[];
    done_at bigint[];
    n integer;
    locked boolean[] := '{}';
    events audit_event_item[] := '{}';
    event_tenants text[] := '{}';
    n_events integer := 0;
    audit_tenant text;
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_finish_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    -- Every row first, in the caller's (tenant, subject, task) order, before any counter: a
    -- cancel locks its row before that requestor's counter. One primary-key lookup each. A row
    -- locked elsewhere (a cancel under way, a transaction left open) is skipped, not waited for:
    -- its item changes nothing and answers NULL, and the runner, reading the task still its own,
    -- writes it again. One such row holds up neither the batch nor the outcomes queued behind it.
    FOR i IN 1 .. n LOOP
        PERFORM 1 FROM tasks WHERE tenant_id = items[i].tenant_id AND task_id = items[i].task_id
        FOR NO KEY UPDATE SKIP LOCKED;
        locked[i] := FOUND;
    END LOOP;
    -- Then one UPDATE for the rows locked, each under its own lease check, so the counter trigger
    -- changes each requestor's counter once for the batch. The rows are locked already: the join
    -- order does not matter. A task named twice is finished once (the first the join meets).
    WITH finished AS (
        UPDATE tasks t
        SET status = u.status, outcome = u.outcome, payload = u.payload, status_message = u.status_message,
            last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
            lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
        FROM unnest(items) WITH ORDINALITY AS u
        WHERE locked[u.ordinality::integer]
          AND t.tenant_id = u.tenant_id AND t.task_id = u.task_id AND t.lease_owner = u.owner
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
"""

# CREATE OR REPLACE resets SECURITY DEFINER and its search_path (the owner stays): restated.
WRAPPER = """
CREATE OR REPLACE FUNCTION task_finish_batch(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    item jsonb;
BEGIN
    FOR item IN SELECT e FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o) ORDER BY o LOOP
        PERFORM 1 FROM tasks WHERE tenant_id = item->>'tenant_id' AND task_id = item->>'task_id'
        FOR NO KEY UPDATE;
    END LOOP;
    RETURN QUERY SELECT * FROM task_finish_batch_nowait(p_items);
END
$$;
ALTER FUNCTION task_finish_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;
"""

GRANTS = """
REVOKE ALL ON FUNCTION task_finish_batch_nowait(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION task_finish_batch_nowait(jsonb) TO mcp_tasks_runner;
ALTER FUNCTION task_finish_batch_nowait(jsonb) OWNER TO mcp_tasks_record;
ALTER FUNCTION task_finish_batch_nowait(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;
"""

OLD = """
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
DROP FUNCTION task_finish_batch_nowait(jsonb);
"""


def upgrade() -> None:
    run_script(NOWAIT + GRANTS + WRAPPER)


def downgrade() -> None:
    run_script(OLD)
