-- name: lock_tenant_creates
-- Serialize task creation per tenant for this transaction, so caps hold across replicas.
SELECT pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || $1, 0));

-- name: count_active
-- Active tasks of one requestor and of the whole tenant, from the counters (migration 0004).
SELECT coalesce(sum(active) FILTER (WHERE subject = $2), 0) AS requestor, coalesce(sum(active), 0) AS tenant
FROM active_tasks
WHERE tenant_id = $1 AND active > 0;

-- name: drop_idle_counters
-- Requestors with no active task: their counter rows go, so a tenant's total sums only busy ones.
DELETE FROM active_tasks WHERE active = 0;
