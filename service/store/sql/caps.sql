-- name: lock_tenant_creates
-- Serialize task creation per tenant for this transaction, so caps hold across replicas.
SELECT pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || $1, 0));

-- name: count_active
-- Active (non-terminal, unexpired) tasks of one requestor and of the whole tenant.
SELECT count(*) FILTER (WHERE subject = $2) AS requestor, count(*) AS tenant
FROM tasks
WHERE tenant_id = $1 AND status IN ('working', 'input_required') AND expires_at > clock_timestamp();
