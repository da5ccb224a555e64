"""A finish batch appends its audit events for all its tenants with one call, not one per tenant.

Revision ID: 0019
Revises: 0018

``task_finish_batch`` appended a batch's ``complete`` events with one ``audit_append_many`` call
per tenant in it, in tenant order: per tenant a call of a ``SECURITY DEFINER`` function, its head
locked and read by one statement, its events inserted by another and its head written by a third.
The new ``audit_append_all`` takes the events of every tenant at once: the heads locked in tenant
order by one statement, every event inserted by one and every head written by one, each chain's
seqs, times and hashes computed as ``audit_append_many`` computes them (a batch of one tenant goes
to ``audit_append_many`` itself, which costs less for one). The heads are read field by field: an
array of rows would be converted through text, and a timestamp written with the session's
``DateStyle`` may read back at another zone's offset (a review of the change found events dated
hours ahead). ``bench/sql_ab.py``, batches of 16: the finish's PostgreSQL CPU per item -13 % over
8 tenants, -26 % over 32, unchanged for one (issue 15; docs/performance.md, twenty-first pass).

No role of the service may call it: only the record's functions do, so it needs no tenant check
(``audit_append_many``'s applies to the app role only, and the runner's finishes never met it).
The app role's batches (``task_batch``: creates and retrievals) still append per tenant through
``audit_append_many``, whose check that the app role appends only to its transaction's tenant
stays (docs/decisions.md).

Locks: the finish locks its rows and counters first, as before; then the heads, in the order the
per-tenant calls took them. A tenant without a head yet (never the case in a finish: the task's
create made it) has it inserted before any head is locked, so that insert waits on no one while
holding a head. Retrievals are refused: their interval rows would be locked before the heads,
where ``audit_append_many`` locks a tenant's after the heads of the tenants before it.
"""

from service.store.sqlscript import run_script

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

UPGRADE = """
-- Append a batch's events of many tenants: p_tenants[i] is the tenant of p_events[i]. Each tenant's
-- events go onto its chain in their order, as audit_append_many would append them (the same seq,
-- time and hash), with the events inserted by one statement and the heads written by one, where
-- per-tenant calls took a function call and three statements each. Locks: a tenant's missing head
-- is inserted before any head is locked, then the heads are locked in tenant order (COLLATE "C"),
-- as the per-tenant calls took them. Not for retrievals (their interval rows would be locked
-- before the heads, where audit_append_many locks a tenant's after the tenants' before it). Not
-- callable by the service's roles: only the record's own functions call it (task_finish_batch),
-- so it has no tenant check of its own (audit_append_many's applies to the app role only). A batch
-- of one tenant goes to audit_append_many, which costs less for one (migration 0019).
CREATE FUNCTION audit_append_all(p_tenants text[], p_events audit_event_item[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    n integer := coalesce(cardinality(p_events), 0);
    tenants text[];
    at_order integer[];
    head_tenant text[];
    head_seq bigint[];
    head_hash bytea[];
    head_at timestamptz[];
    ev audit_event_item;
    e audit_events;
    chain audit_events[] := '{}';
    h integer := 0;
    k integer;
    retrievals boolean;
BEGIN
    IF n = 0 THEN
        RETURN;
    ELSIF cardinality(p_tenants) IS DISTINCT FROM n OR array_lower(p_tenants, 1) <> 1 OR array_lower(p_events, 1) <> 1
          OR array_position(p_tenants, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'audit_append_all: one tenant for every event' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The events by tenant (in tenant order), each tenant's in their order; the tenants in order.
    SELECT array_agg(x.o ORDER BY x.t COLLATE "C", x.o), array_agg(DISTINCT x.t COLLATE "C" ORDER BY x.t COLLATE "C"),
           bool_or((p_events[x.o]).action = 'retrieve')
        INTO at_order, tenants, retrievals
    FROM unnest(p_tenants) WITH ORDINALITY AS x(t, o);
    IF retrievals THEN
        RAISE EXCEPTION 'audit_append_all: retrievals go through audit_append_many' USING ERRCODE = 'invalid_parameter_value';
    ELSIF cardinality(tenants) = 1 THEN
        PERFORM audit_append_many(tenants[1], p_events);
        RETURN;
    END IF;
    -- A tenant's first event: its head is made before any head is locked, in tenant order.
    IF (SELECT count(*) FROM audit_heads WHERE tenant_id = ANY (tenants)) < cardinality(tenants) THEN
        INSERT INTO audit_heads (tenant_id, seq, hash)
        SELECT t, 0, decode(repeat('00', 32), 'hex') FROM unnest(tenants) AS t ORDER BY t COLLATE "C"
        ON CONFLICT (tenant_id) DO NOTHING;
    END IF;
    -- The heads, locked in tenant order (rows are locked as the sort returns them), read field by
    -- field: a row array would be converted through text, its time by the session's DateStyle.
    SELECT array_agg(l.tenant_id ORDER BY l.tenant_id COLLATE "C"), array_agg(l.seq ORDER BY l.tenant_id COLLATE "C"),
           array_agg(l.hash ORDER BY l.tenant_id COLLATE "C"), array_agg(l.at ORDER BY l.tenant_id COLLATE "C")
        INTO head_tenant, head_seq, head_hash, head_at
    FROM (SELECT tenant_id, seq, hash, at FROM audit_heads WHERE tenant_id = ANY (tenants)
          ORDER BY tenant_id COLLATE "C" FOR UPDATE) l;
    FOREACH k IN ARRAY at_order LOOP
        IF h = 0 OR e.tenant_id <> p_tenants[k] THEN  -- the next tenant's chain
            IF h > 0 THEN
                head_seq[h] := e.seq; head_hash[h] := e.hash; head_at[h] := e.at;
            END IF;
            h := h + 1;
            IF head_tenant[h] IS DISTINCT FROM p_tenants[k] THEN  -- never append to another chain
                RAISE EXCEPTION 'audit_append_all: no head for tenant %', p_tenants[k];
            END IF;
            e.tenant_id := head_tenant[h]; e.seq := head_seq[h]; e.hash := head_hash[h]; e.at := head_at[h];
        END IF;
        ev := p_events[k];
        e.seq := e.seq + 1; e.at := greatest(clock_timestamp(), e.at);
        e.action := ev.action; e.outcome := ev.outcome;
        e.subject := coalesce(ev.subject, ''); e.client_id := coalesce(ev.client_id, '');
        e.issuer := coalesce(ev.issuer, ''); e.task_id := ev.task_id; e.request_id := ev.request_id;
        e.client_address := ev.client_address; e.detail := ev.detail; e.prev_hash := e.hash;
        e.hash := sha256(e.prev_hash || convert_to(audit_canonical(e), 'UTF8'));
        chain[cardinality(chain) + 1] := e;
    END LOOP;
    head_seq[h] := e.seq; head_hash[h] := e.hash; head_at[h] := e.at;
    INSERT INTO audit_events SELECT * FROM unnest(chain);
    -- Each head by key (ANY), whatever plan a join of the heads with an array would get.
    UPDATE audit_heads
    SET seq = head_seq[array_position(head_tenant, tenant_id)], hash = head_hash[array_position(head_tenant, tenant_id)],
        at = head_at[array_position(head_tenant, tenant_id)]
    WHERE tenant_id = ANY (head_tenant);
END
$$;
ALTER FUNCTION audit_append_all(text[], audit_event_item[]) OWNER TO mcp_tasks_record;
REVOKE ALL ON FUNCTION audit_append_all(text[], audit_event_item[]) FROM PUBLIC;

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
        PERFORM audit_append_all(event_tenants, events);
    END IF;
    FOR i IN 1 .. n LOOP
        RETURN NEXT done_tasks[i];
    END LOOP;
END
$$;
ALTER FUNCTION task_finish_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public
    SET enable_hashjoin = off SET enable_mergejoin = off SET enable_seqscan = off;
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
DROP FUNCTION audit_append_all(text[], audit_event_item[]);
"""


def upgrade() -> None:
    run_script(UPGRADE)


def downgrade() -> None:
    run_script(DOWNGRADE)
