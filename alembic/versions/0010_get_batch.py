"""Gets read by their own batch function: arrays in, one set-based read per tenant (issue 15, point 2).

Revision ID: 0010
Revises: 0009

A batch of gets went through ``task_batch`` like creates and retrieves: the items as jsonb, each
parsed into a record, the tenant set and its row read one item at a time, then the loop over the
items for audit events that gets never have. Measured on a batch of 15 gets (PostgreSQL's CPU, our
client's the same): 250 us over 8 tenants, 95-100 us with ``task_get_batch`` for one tenant and
170-180 us for 8, against a per-item loop's 155-170 us whatever the tenants.

- ``task_get_batch(tenants, task_ids, subjects)``: the items as three arrays (the batcher sorts
  them by tenant), one ``RETURN QUERY`` per distinct tenant with that tenant set for row-level
  security (as every statement of the app role), each item's row by primary key when it is the
  item's subject's and unexpired, with the item's place (``o``); items without a row return
  nothing. The caller checks every row against its item (tenant and task id by place).
- ``task_batch`` still answers get items: replicas of the previous release send them there
  during a rolling upgrade. A later migration drops them.
"""

from service.store.sqlscript import run_script

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

GET_BATCH = """
CREATE FUNCTION task_get_batch(p_tenants text[], p_task_ids text[], p_subjects text[])
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

REVOKE ALL ON FUNCTION task_get_batch(text[], text[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION task_get_batch(text[], text[], text[]) TO mcp_tasks_app;
"""


def upgrade() -> None:
    run_script(GET_BATCH)


def downgrade() -> None:
    run_script("DROP FUNCTION task_get_batch(text[], text[], text[]);")
