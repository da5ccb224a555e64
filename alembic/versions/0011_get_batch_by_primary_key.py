"""Gets by primary key whatever the planner knows (a fix of 0010).

Revision ID: 0011
Revises: 0010

``task_get_batch`` joined each item to its row on tenant, task id *and* subject. On a table with
no statistics (a new deployment, or one that grew faster than autovacuum analyses it) the planner
took ``tasks_owner_recent`` (tenant, subject, created_at, task_id) for that join and walked every
task of the item's subject to find one: for one principal holding 6,400 tasks, 98 buffers and
about 11 ms of PostgreSQL CPU per batch of 15 gets, against 5 buffers and 0.5 ms by primary key.
``make bench`` showed it as one principal's gets at 0.55x the spread ones. (``task_batch`` had
already learnt this: its gets read by primary key and check the owner after.)

Now each item's row is read by primary key alone in a subquery the planner may not flatten
(``OFFSET 0``: no condition on the subject or the expiry can be pushed into it, so only the
primary key matches its conditions), and the subject and the expiry are checked on the row found.
Same signature, result and grants.
"""

from service.store.sqlscript import run_script

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

GET_BATCH_NEW = """
CREATE OR REPLACE FUNCTION task_get_batch(p_tenants text[], p_task_ids text[], p_subjects text[])
RETURNS TABLE (o integer, tenant_id text, task_id text, subject text, issuer text, client_id text,
               session_id text, surface text, tool text, progress_token jsonb, status task_status,
               status_message text, outcome text, payload jsonb, ttl_ms bigint, poll_interval_ms integer,
               created_at timestamptz, last_updated_at timestamptz, attempts integer, expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    tenant text;
BEGIN
    -- One set-based read per tenant of the batch, under that tenant's row-level security; each
    -- item's row by primary key alone (a subquery kept whole by OFFSET 0: with the subject among
    -- its conditions the planner may walk tasks_owner_recent, every task of the subject), then
    -- kept when it is the item's subject's and unexpired, with the item's place.
    FOR tenant IN SELECT DISTINCT u FROM unnest(p_tenants) AS u LOOP
        PERFORM set_config('app.tenant_id', tenant, true);
        RETURN QUERY
        SELECT w.o::integer, t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.surface,
               t.tool, t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
               t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at
        FROM unnest(p_tenants, p_task_ids, p_subjects) WITH ORDINALITY AS w(tenant_id, task_id, subject, o)
        CROSS JOIN LATERAL (
            SELECT k.tenant_id, k.task_id, k.subject, k.issuer, k.client_id, k.session_id, k.surface, k.tool,
                   k.progress_token, k.status, k.status_message, k.outcome, k.payload, k.ttl_ms,
                   k.poll_interval_ms, k.created_at, k.last_updated_at, k.attempts, k.expires_at
            FROM tasks k
            WHERE k.tenant_id = w.tenant_id AND k.task_id = w.task_id
            OFFSET 0
        ) t
        WHERE w.tenant_id = tenant AND t.subject = w.subject AND t.expires_at > clock_timestamp();
    END LOOP;
END
$$;
"""

GET_BATCH_OLD = """
CREATE OR REPLACE FUNCTION task_get_batch(p_tenants text[], p_task_ids text[], p_subjects text[])
RETURNS TABLE (o integer, tenant_id text, task_id text, subject text, issuer text, client_id text,
               session_id text, surface text, tool text, progress_token jsonb, status task_status,
               status_message text, outcome text, payload jsonb, ttl_ms bigint, poll_interval_ms integer,
               created_at timestamptz, last_updated_at timestamptz, attempts integer, expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    tenant text;
BEGIN
    -- One set-based read per tenant of the batch, under that tenant's row-level security; each
    -- item's row (by primary key) when it is the item's subject's and unexpired, with its place.
    FOR tenant IN SELECT DISTINCT u FROM unnest(p_tenants) AS u LOOP
        PERFORM set_config('app.tenant_id', tenant, true);
        RETURN QUERY
        SELECT w.o::integer, t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.surface,
               t.tool, t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
               t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at
        FROM unnest(p_tenants, p_task_ids, p_subjects) WITH ORDINALITY AS w(tenant_id, task_id, subject, o)
        JOIN tasks t ON t.tenant_id = w.tenant_id AND t.task_id = w.task_id
        WHERE w.tenant_id = tenant AND t.subject = w.subject AND t.expires_at > clock_timestamp();
    END LOOP;
END
$$;
"""


def upgrade() -> None:
    run_script(GET_BATCH_NEW)


def downgrade() -> None:
    run_script(GET_BATCH_OLD)
