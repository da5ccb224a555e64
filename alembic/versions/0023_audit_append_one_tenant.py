"""The audit chain step costs less for one tenant's events: audit_append_events locks and writes
that tenant's head by key, without the sort, the count and the array lookups that many tenants'
events need (every request's append is one tenant's). The same events, hashes, errors and locks:
the body is replaced in place (CONTRIBUTING.md, "Change a SQL function").

Revision ID: 0023
Revises: 0022

Append-only: once committed, this file never changes (docs/decisions.md). A changed SQL function
is created here with its full new body; alembic/schema.sql gets the same change.
"""

from service.store.sqlscript import run_script

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    CREATE OR REPLACE FUNCTION audit_append_events(p_tenants text[], p_events audit_event_item[]) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
    DECLARE
        n integer := coalesce(cardinality(p_events), 0);
        kept_tenants text[] := '{}';
        kept audit_event_item[] := '{}';
        m integer := 0;
        ev audit_event_item;
        repeats bigint;
        tenants text[];
        at_order integer[];
        head_tenant text[];
        head_seq bigint[];
        head_hash bytea[];
        head_at timestamptz[];
        head audit_heads;
        e audit_events;
        chain audit_events[] := '{}';
        h integer := 0;
        k integer;
    BEGIN
        IF cardinality(p_tenants) IS DISTINCT FROM n OR array_position(p_tenants, NULL) IS NOT NULL
           OR (n > 0 AND (array_lower(p_tenants, 1) <> 1 OR array_lower(p_events, 1) <> 1)) THEN
            RAISE EXCEPTION 'audit_append_events: one tenant for every event' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF current_setting('role') = 'mcp_tasks_app'
           AND NOT coalesce(current_setting('app.tenant_id', true) = ALL (p_tenants), false) THEN
            RAISE EXCEPTION 'audit_append_events: not the transaction''s tenant' USING ERRCODE = 'insufficient_privilege';
        END IF;
        FOR i IN 1 .. n LOOP
            ev := p_events[i];
            ev.subject := coalesce(ev.subject, '');
            IF ev.action = 'retrieve' AND ev.task_id IS NOT NULL THEN
                repeats := audit_retrieval_due(p_tenants[i], ev.task_id, ev.subject);
                CONTINUE WHEN repeats IS NULL;
                IF repeats > 0 THEN
                    ev.detail := coalesce(ev.detail, '{}') || jsonb_build_object('repeats_before', repeats);
                END IF;
            END IF;
            m := m + 1;
            kept_tenants[m] := p_tenants[i];
            kept[m] := ev;
        END LOOP;
        IF m = 0 THEN
            RETURN NULL;
        END IF;
        IF kept_tenants[1] = ALL (kept_tenants) THEN  -- one tenant (every request's append): its head by key
            SELECT * INTO head FROM audit_heads WHERE tenant_id = kept_tenants[1] FOR UPDATE;
            IF NOT FOUND THEN  -- the tenant's first event
                INSERT INTO audit_heads (tenant_id, seq, hash) VALUES (kept_tenants[1], 0, decode(repeat('00', 32), 'hex'))
                    ON CONFLICT (tenant_id) DO NOTHING;
                SELECT * INTO head FROM audit_heads WHERE tenant_id = kept_tenants[1] FOR UPDATE;
            END IF;
            at_order := array(SELECT generate_series(1, m));
            head_tenant := ARRAY[head.tenant_id]; head_seq := ARRAY[head.seq];
            head_hash := ARRAY[head.hash]; head_at := ARRAY[head.at];
        ELSE
            -- The events by tenant (in tenant order), each tenant's in their order; the tenants in order.
            SELECT array_agg(x.o ORDER BY x.t COLLATE "C", x.o), array_agg(DISTINCT x.t COLLATE "C" ORDER BY x.t COLLATE "C")
                INTO at_order, tenants
            FROM unnest(kept_tenants) WITH ORDINALITY AS x(t, o);
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
        END IF;
        -- The chain step, for every event.
        FOREACH k IN ARRAY at_order LOOP
            IF h = 0 OR e.tenant_id <> kept_tenants[k] THEN  -- the next tenant's chain
                IF h > 0 THEN
                    head_seq[h] := e.seq; head_hash[h] := e.hash; head_at[h] := e.at;
                END IF;
                h := h + 1;
                IF head_tenant[h] IS DISTINCT FROM kept_tenants[k] THEN  -- never append to another chain
                    RAISE EXCEPTION 'audit_append_events: no head for tenant %', kept_tenants[k];
                END IF;
                e.tenant_id := head_tenant[h]; e.seq := head_seq[h]; e.hash := head_hash[h]; e.at := head_at[h];
            END IF;
            ev := kept[k];
            e.seq := e.seq + 1; e.at := greatest(clock_timestamp(), e.at);
            e.action := ev.action; e.outcome := ev.outcome;
            e.subject := ev.subject; e.client_id := coalesce(ev.client_id, '');
            e.issuer := coalesce(ev.issuer, ''); e.task_id := ev.task_id; e.request_id := ev.request_id;
            e.client_address := ev.client_address; e.detail := ev.detail; e.prev_hash := e.hash;
            e.hash := sha256(e.prev_hash || convert_to(audit_canonical(e), 'UTF8'));
            chain[cardinality(chain) + 1] := e;
        END LOOP;
        head_seq[h] := e.seq; head_hash[h] := e.hash; head_at[h] := e.at;
        IF m = 1 THEN  -- one event: inserted as a row (cheaper than unnest of one)
            INSERT INTO audit_events VALUES (e.*);
        ELSE
            INSERT INTO audit_events SELECT * FROM unnest(chain);
        END IF;
        IF h = 1 THEN
            UPDATE audit_heads SET seq = e.seq, hash = e.hash, at = e.at WHERE tenant_id = e.tenant_id;
        ELSE
            -- Each head by key (ANY), whatever plan a join of the heads with an array would get.
            UPDATE audit_heads
            SET seq = head_seq[array_position(head_tenant, tenant_id)], hash = head_hash[array_position(head_tenant, tenant_id)],
                at = head_at[array_position(head_tenant, tenant_id)]
            WHERE tenant_id = ANY (head_tenant);
        END IF;
        RETURN e.seq;
    END
    $$;
    """)


def downgrade() -> None:
    run_script("""
    CREATE OR REPLACE FUNCTION audit_append_events(p_tenants text[], p_events audit_event_item[]) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
    DECLARE
        n integer := coalesce(cardinality(p_events), 0);
        kept_tenants text[] := '{}';
        kept audit_event_item[] := '{}';
        m integer := 0;
        ev audit_event_item;
        repeats bigint;
        tenants text[];
        at_order integer[];
        head_tenant text[];
        head_seq bigint[];
        head_hash bytea[];
        head_at timestamptz[];
        e audit_events;
        chain audit_events[] := '{}';
        h integer := 0;
        k integer;
    BEGIN
        IF cardinality(p_tenants) IS DISTINCT FROM n OR array_position(p_tenants, NULL) IS NOT NULL
           OR (n > 0 AND (array_lower(p_tenants, 1) <> 1 OR array_lower(p_events, 1) <> 1)) THEN
            RAISE EXCEPTION 'audit_append_events: one tenant for every event' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF current_setting('role') = 'mcp_tasks_app'
           AND EXISTS (SELECT 1 FROM unnest(p_tenants) AS t WHERE t IS DISTINCT FROM current_setting('app.tenant_id', true)) THEN
            RAISE EXCEPTION 'audit_append_events: not the transaction''s tenant' USING ERRCODE = 'insufficient_privilege';
        END IF;
        FOR i IN 1 .. n LOOP
            ev := p_events[i];
            ev.subject := coalesce(ev.subject, '');
            IF ev.action = 'retrieve' AND ev.task_id IS NOT NULL THEN
                repeats := audit_retrieval_due(p_tenants[i], ev.task_id, ev.subject);
                CONTINUE WHEN repeats IS NULL;
                IF repeats > 0 THEN
                    ev.detail := coalesce(ev.detail, '{}') || jsonb_build_object('repeats_before', repeats);
                END IF;
            END IF;
            m := m + 1;
            kept_tenants[m] := p_tenants[i];
            kept[m] := ev;
        END LOOP;
        IF m = 0 THEN
            RETURN NULL;
        END IF;
        -- The events by tenant (in tenant order), each tenant's in their order; the tenants in order.
        SELECT array_agg(x.o ORDER BY x.t COLLATE "C", x.o), array_agg(DISTINCT x.t COLLATE "C" ORDER BY x.t COLLATE "C")
            INTO at_order, tenants
        FROM unnest(kept_tenants) WITH ORDINALITY AS x(t, o);
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
        -- The chain step, for every event.
        FOREACH k IN ARRAY at_order LOOP
            IF h = 0 OR e.tenant_id <> kept_tenants[k] THEN  -- the next tenant's chain
                IF h > 0 THEN
                    head_seq[h] := e.seq; head_hash[h] := e.hash; head_at[h] := e.at;
                END IF;
                h := h + 1;
                IF head_tenant[h] IS DISTINCT FROM kept_tenants[k] THEN  -- never append to another chain
                    RAISE EXCEPTION 'audit_append_events: no head for tenant %', kept_tenants[k];
                END IF;
                e.tenant_id := head_tenant[h]; e.seq := head_seq[h]; e.hash := head_hash[h]; e.at := head_at[h];
            END IF;
            ev := kept[k];
            e.seq := e.seq + 1; e.at := greatest(clock_timestamp(), e.at);
            e.action := ev.action; e.outcome := ev.outcome;
            e.subject := ev.subject; e.client_id := coalesce(ev.client_id, '');
            e.issuer := coalesce(ev.issuer, ''); e.task_id := ev.task_id; e.request_id := ev.request_id;
            e.client_address := ev.client_address; e.detail := ev.detail; e.prev_hash := e.hash;
            e.hash := sha256(e.prev_hash || convert_to(audit_canonical(e), 'UTF8'));
            chain[cardinality(chain) + 1] := e;
        END LOOP;
        head_seq[h] := e.seq; head_hash[h] := e.hash; head_at[h] := e.at;
        IF m = 1 THEN  -- one event: inserted as a row (cheaper than unnest of one)
            INSERT INTO audit_events VALUES (e.*);
        ELSE
            INSERT INTO audit_events SELECT * FROM unnest(chain);
        END IF;
        -- Each head by key (ANY), whatever plan a join of the heads with an array would get.
        UPDATE audit_heads
        SET seq = head_seq[array_position(head_tenant, tenant_id)], hash = head_hash[array_position(head_tenant, tenant_id)],
            at = head_at[array_position(head_tenant, tenant_id)]
        WHERE tenant_id = ANY (head_tenant);
        RETURN e.seq;
    END
    $$;
    """)
