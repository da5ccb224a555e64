-- Audit trails for reviewers (`mcp-tasks audit trail`, docs/decisions.md "Audit trails"). The rows
-- are read as mcp_tasks_app with the one tenant set, so row-level security keeps every other
-- tenant's rows out whatever these queries say; only the tenant lookups read across tenants.

-- name: audit_trail_of_task
-- Every row of the transaction's tenant about one task, in chain order.
SELECT tenant_id, seq, at, action, outcome, subject, client_id, issuer, task_id, request_id, client_address,
       detail, encode(prev_hash, 'hex') AS prev_hash, encode(hash, 'hex') AS hash
FROM audit_events
WHERE tenant_id = $1 AND task_id = $2
ORDER BY seq;

-- name: audit_trail_of_subject
-- What one identity of the transaction's tenant did from $3 on (and before $4), in chain order.
SELECT tenant_id, seq, at, action, outcome, subject, client_id, issuer, task_id, request_id, client_address,
       detail, encode(prev_hash, 'hex') AS prev_hash, encode(hash, 'hex') AS hash
FROM audit_events
WHERE tenant_id = $1 AND subject = $2 AND at >= $3 AND at < coalesce($4::timestamptz, 'infinity')
ORDER BY seq;

-- name: audit_tenant_creating_task
-- The tenant whose chain records the task's creation (task ids are 256-bit and made by the server:
-- one tenant at most; others' chains may name the id only in their own denials).
SELECT tenant_id FROM audit_events WHERE task_id = $1 AND action = 'create' ORDER BY tenant_id COLLATE "C" LIMIT 2;

-- name: audit_tenants_of_subject
-- The tenants whose chains hold rows of a subject from $2 on: a name is one identity per tenant.
SELECT DISTINCT tenant_id FROM audit_events WHERE subject = $1 AND at >= $2 ORDER BY 1 LIMIT 20;
