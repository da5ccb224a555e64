-- name: lock_tenant_creates
-- Serialize task creation per tenant for this transaction, so caps hold across replicas.
SELECT pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || $1, 0));

-- name: count_active
-- Active tasks of one requestor and of the whole tenant, from the counters.
SELECT coalesce(sum(active) FILTER (WHERE subject = $2), 0) AS requestor, coalesce(sum(active), 0) AS tenant
FROM active_tasks
WHERE tenant_id = $1 AND active > 0;

-- name: count_held
-- What a cap or the storage quota refused a create against: the requestor's and the tenant's
-- active tasks, and the bytes the tenant's tasks keep.
SELECT coalesce(sum(active) FILTER (WHERE subject = $2 AND active > 0), 0) AS requestor,
       coalesce(sum(active) FILTER (WHERE active > 0), 0) AS tenant,
       greatest(coalesce(sum(bytes), 0), 0) AS bytes
FROM active_tasks
WHERE tenant_id = $1;

-- name: drop_idle_counters
-- Requestors with no active task and no bytes kept: their counter rows go, so a tenant's sums read
-- only requestors with something. A row whose requestor has no task left at all goes too, whatever
-- its bytes say (a row an older release's sweeper dropped while it still had bytes comes back
-- negative when those tasks go: this ends it). In (tenant, subject) code point order, skipping rows
-- a create or finish holds: counters are locked in that order everywhere (a batch of creates may
-- hold one and want the next).
DELETE FROM active_tasks a
USING (
    SELECT c.tenant_id, c.subject FROM active_tasks c
    WHERE c.active = 0
      AND (c.bytes = 0 OR NOT EXISTS (SELECT FROM tasks t WHERE t.tenant_id = c.tenant_id AND t.subject = c.subject))
    ORDER BY c.tenant_id COLLATE "C", c.subject COLLATE "C"
    FOR UPDATE OF c SKIP LOCKED
) idle
WHERE a.tenant_id = idle.tenant_id AND a.subject = idle.subject AND a.active = 0;
