"""A task's trace context read back (issue 44): task_get_v2 and task_retrieve_v2 return
tasks.trace_parent too, so a later request about a task links to the trace of the request that
created it. task_get and task_retrieve stay while the previous release may run beside this one.

Revision ID: 0029
Revises: 0028

Append-only: once committed, this file never changes (docs/decisions.md). A changed SQL function
is created here with its full new body; alembic/schema.sql gets the same change.
"""

from service.store.sqlscript import run_script

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    -- ======================================================= a task's trace context, read back ==
    -- Gets and retrieves with the task's trace_parent (issue 44): a later request about a task links to
    -- the trace of the request that created it. task_get and task_retrieve above stay while the
    -- previous release may run beside this one.
    CREATE FUNCTION task_get_v2(p_tenants text[], p_task_ids text[], p_subjects text[])
    RETURNS TABLE (o integer, tenant_id text, task_id text, subject text, issuer text, client_id text,
                   session_id text, wire text, tool text, progress_token jsonb, status task_status,
                   status_message text, outcome text, payload jsonb, ttl_ms bigint, poll_interval_ms integer,
                   created_at timestamptz, last_updated_at timestamptz, attempts integer, expires_at timestamptz,
                   trace_parent text)
    LANGUAGE plpgsql AS $$
    #variable_conflict use_column
    DECLARE
        tenant text;
    BEGIN
        -- Each item's row by primary key alone (a subquery kept whole by OFFSET 0: with the subject
        -- among its conditions the planner may walk tasks_owner_recent, every task of the subject),
        -- then kept when it is the item's subject's and unexpired, with the item's place.
        FOR tenant IN SELECT DISTINCT u FROM unnest(p_tenants) AS u LOOP
            PERFORM set_config('app.tenant_id', tenant, true);
            RETURN QUERY
            SELECT w.o::integer, t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.wire,
                   t.tool, t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
                   t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at, t.trace_parent
            FROM unnest(p_tenants, p_task_ids, p_subjects) WITH ORDINALITY AS w(tenant_id, task_id, subject, o)
            CROSS JOIN LATERAL (
                SELECT k.tenant_id, k.task_id, k.subject, k.issuer, k.client_id, k.session_id, k.wire, k.tool,
                       k.progress_token, k.status, k.status_message, k.outcome, k.payload, k.ttl_ms,
                       k.poll_interval_ms, k.created_at, k.last_updated_at, k.attempts, k.expires_at, k.trace_parent
                FROM tasks k
                WHERE k.tenant_id = w.tenant_id AND k.task_id = w.task_id
                OFFSET 0
            ) t
            WHERE w.tenant_id = tenant AND t.subject = w.subject AND t.expires_at > clock_timestamp();
        END LOOP;
    END
    $$;

    CREATE FUNCTION task_retrieve_v2(p_items jsonb) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        items task_retrieve_item[];
        it task_retrieve_item;
        found_tasks tasks[];
        t tasks;
        tenant text;
        n integer;
    BEGIN
        SELECT array_agg(jsonb_populate_record(NULL::task_retrieve_item, e) ORDER BY o) INTO items
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
        n := coalesce(array_length(items, 1), 0);
        FOR i IN 1 .. n LOOP
            it := items[i];
            t := NULL;
            PERFORM set_config('app.tenant_id', it.tenant_id, true);
            -- Only what a lookup answers with (not the arguments nor the client's capabilities), by
            -- primary key alone, then the owner and the expiry checked here (as task_get).
            SELECT tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool, progress_token,
                   status, status_message, outcome, payload, ttl_ms, poll_interval_ms, created_at,
                   last_updated_at, attempts, expires_at, trace_parent
            INTO t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.wire, t.tool,
                 t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
                 t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at, t.trace_parent
            FROM tasks
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id;
            IF t.task_id IS NOT NULL AND (t.subject <> it.subject OR NOT t.expires_at > clock_timestamp()) THEN
                t := NULL;
            END IF;
            found_tasks[i] := t;
        END LOOP;
        -- The hand-outs of finished tasks, appended per tenant in tenant order, under that tenant.
        FOR tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
            PERFORM set_config('app.tenant_id', tenant, true);
            PERFORM audit_append_events(array_agg(tenant), array_agg(
                        ROW('retrieve', (found_tasks[x.ordinality]).status::text, x.subject, x.client_id, x.issuer,
                            x.task_id, x.request_id, x.client_address, NULL)::audit_event_item ORDER BY x.ordinality))
            FROM unnest(items) WITH ORDINALITY AS x
            WHERE x.tenant_id = tenant AND (found_tasks[x.ordinality]).task_id IS NOT NULL
              AND NOT task_status_active((found_tasks[x.ordinality]).status)
            HAVING count(*) > 0;
        END LOOP;
        FOR i IN 1 .. n LOOP
            RETURN NEXT found_tasks[i];
        END LOOP;
    END
    $$;

    REVOKE ALL ON FUNCTION task_get_v2(text[], text[], text[]), task_retrieve_v2(jsonb) FROM PUBLIC;
    GRANT EXECUTE ON FUNCTION task_get_v2(text[], text[], text[]), task_retrieve_v2(jsonb) TO mcp_tasks_app;
    """)


def downgrade() -> None:
    run_script("""
    DROP FUNCTION task_get_v2(text[], text[], text[]), task_retrieve_v2(jsonb);
    """)
