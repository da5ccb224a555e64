-- name: lock_tenant_creates
-- Serialize task creation per tenant for this transaction, so caps hold across replicas.
SELECT pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || $1, 0));

-- name: count_active
-- Active tasks of one requestor and of the whole tenant, from the counters.
SELECT coalesce(sum(active) FILTER (WHERE subject = $2), 0) AS requestor, coalesce(sum(active), 0) AS tenant
FROM active_tasks
WHERE tenant_id = $1 AND active > 0;

-- name: drop_idle_counters
-- Requestors with no active task: their counter rows go, so a tenant's total sums only busy ones.
-- In (tenant, subject) code point order, skipping rows a create or finish holds: counters are
-- locked in that order everywhere (a batch of creates may hold one and want the next).
DELETE FROM active_tasks a
USING (
    SELECT tenant_id, subject FROM active_tasks WHERE active = 0
    ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
    FOR UPDATE SKIP LOCKED
) idle
WHERE a.tenant_id = idle.tenant_id AND a.subject = idle.subject AND a.active = 0;
