-- name: get_task
-- One task of one owner; expired rows are invisible even before the sweeper deletes them.
SELECT * FROM tasks
WHERE tenant_id = $1 AND task_id = $2 AND subject = $3 AND expires_at > clock_timestamp();

-- name: get_leased_task
-- An active task leased to this runner (after a create whose answer was lost).
SELECT * FROM tasks
WHERE tenant_id = $1 AND task_id = $2 AND lease_owner = $3 AND task_status_active(status);

-- name: list_tasks_first
-- First page of an owner's 2025-11-25 tasks, newest first (the extension has no list, X-SEC-4).
-- Only the columns a listed task shows: no arguments, capabilities or result (issue 14 §4).
SELECT tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool, progress_token, status,
       status_message, outcome, ttl_ms, poll_interval_ms, created_at, last_updated_at, attempts
FROM tasks
WHERE tenant_id = $1 AND subject = $2 AND expires_at > clock_timestamp() AND surface = '2025-11-25'
ORDER BY created_at DESC, task_id DESC
LIMIT $3;

-- name: list_tasks_after
-- Next page after the keyset (created_at, task_id) carried by the cursor; the same columns.
SELECT tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool, progress_token, status,
       status_message, outcome, ttl_ms, poll_interval_ms, created_at, last_updated_at, attempts
FROM tasks
WHERE tenant_id = $1 AND subject = $2 AND expires_at > clock_timestamp() AND surface = '2025-11-25'
  AND (created_at, task_id) < ($3, $4)
ORDER BY created_at DESC, task_id DESC
LIMIT $5;

-- name: cancel_task
-- Cancel wins: only an active task moves, and its lease is dropped so a late completion finds nothing.
UPDATE tasks
SET status = 'cancelled', status_message = $4, last_updated_at = clock_timestamp(),
    finished_at = clock_timestamp(), lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
WHERE tenant_id = $1 AND task_id = $2 AND subject = $3
  AND task_status_active(status) AND expires_at > clock_timestamp()
RETURNING *;

-- name: claim_tasks
-- SKIP LOCKED lets every runner of every replica claim different rows without waiting on each other.
-- Only tasks whose tool this runner has ($5): a fleet whose processes load different tool packs (a
-- rolling deploy adding one, a separate worker pool) leaves a task for a runner that can run it.
UPDATE tasks t
SET lease_owner = $1, lease_key = $2, lease_expires_at = clock_timestamp() + $3 * interval '1 millisecond',
    attempts = t.attempts + 1, started_at = coalesce(t.started_at, clock_timestamp())
FROM (
    SELECT tenant_id, task_id FROM tasks
    WHERE status = 'working' AND lease_owner IS NULL AND expires_at > clock_timestamp()
      AND tool = ANY ($5::text[])
    ORDER BY created_at
    LIMIT $4
    FOR UPDATE SKIP LOCKED
) picked
WHERE t.tenant_id = picked.tenant_id AND t.task_id = picked.task_id
RETURNING t.*;

-- name: renew_leases
-- Heartbeat for the tasks this runner is executing now; rows gone, cancelled or taken are not returned.
-- Leases of tasks it no longer executes are left to lapse, so the reaper handles them.
-- Rows are locked in (tenant, subject, task) order, as a batch of finishes locks them.
UPDATE tasks t
SET lease_expires_at = clock_timestamp() + $2 * interval '1 millisecond'
FROM (
    SELECT h.tenant_id, h.task_id FROM tasks h
    JOIN unnest($3::text[], $4::text[]) AS running(tenant_id, task_id)
      ON h.tenant_id = running.tenant_id AND h.task_id = running.task_id
    WHERE h.lease_owner = $1 AND task_status_active(h.status)
    ORDER BY h.tenant_id COLLATE "C", h.subject COLLATE "C", h.task_id COLLATE "C"
    FOR NO KEY UPDATE OF h
) held
WHERE t.tenant_id = held.tenant_id AND t.task_id = held.task_id
RETURNING t.tenant_id, t.task_id;

-- name: find_lost_leases
-- Leases whose time ran out, or whose owner's session-level advisory lock is gone (process died).
-- Not locked here: task_release_batch re-checks the owner under the row lock.
SELECT tenant_id, task_id, subject, tool, attempts, lease_owner FROM tasks t
WHERE lease_owner IS NOT NULL
  AND (lease_expires_at < clock_timestamp()
       OR NOT EXISTS (SELECT 1 FROM pg_locks l
                      WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                        AND l.classid::bigint = ((t.lease_key >> 32) & 4294967295)
                        AND l.objid::bigint = (t.lease_key & 4294967295)))
ORDER BY lease_expires_at
LIMIT $1;

-- name: delete_expired_tasks
-- One sweeper batch; SKIP LOCKED keeps concurrent sweepers from blocking each other.
DELETE FROM tasks t
USING (
    SELECT tenant_id, task_id FROM tasks
    WHERE expires_at <= statement_timestamp()  -- stable, so the expiry index bounds the scan
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
) doomed
WHERE t.tenant_id = doomed.tenant_id AND t.task_id = doomed.task_id
RETURNING t.*;

-- name: count_active_by_status
-- Cluster-wide non-terminal tasks by status, for the tasks_active gauge: the active total from the
-- per-requestor counters, input_required from its own small partial index (migration 0005), so the
-- cost does not grow with the tasks running.
SELECT (SELECT coalesce(sum(active), 0) FROM active_tasks)::bigint AS active,
       (SELECT count(*) FROM tasks WHERE status = 'input_required') AS input_required;

-- name: task_batch
-- Many creates, gets and retrieves in one statement and one commit (migration 0005): one row per
-- item, in order; a row of NULLs where there is no task.
SELECT * FROM task_batch($1);

-- name: finish_task_batch
-- Many runner outcomes with their audit events and wake-ups in one statement (migration 0005).
SELECT * FROM task_finish_batch($1);

-- name: release_task_batch
-- Runners give tasks back (shutdown, lost lease): re-queued or failed, audited, woken (the one hand-back path).
SELECT * FROM task_release_batch($1);

-- name: queue_by_tool
-- Queued (working, unclaimed) and running (claimed) tasks per tool, with the age of the oldest of
-- each, for the queue gauges. It reads the active rows only (the sweeper's pass, not a request's).
SELECT tool,
       count(*) FILTER (WHERE lease_owner IS NULL AND status = 'working') AS queued,
       count(*) FILTER (WHERE lease_owner IS NOT NULL) AS running,
       coalesce(extract(epoch FROM clock_timestamp() - min(created_at)
                FILTER (WHERE lease_owner IS NULL AND status = 'working')), 0) AS oldest_queued_s,
       coalesce(extract(epoch FROM clock_timestamp() - min(coalesce(started_at, created_at))
                FILTER (WHERE lease_owner IS NOT NULL)), 0) AS oldest_running_s
FROM tasks
WHERE task_status_active(status) AND expires_at > clock_timestamp()
GROUP BY tool;

-- name: active_by_tenant
-- Active tasks per tenant, from the counters (for the opt-in per-tenant gauge).
SELECT tenant_id, sum(active)::bigint AS active FROM active_tasks WHERE active > 0 GROUP BY tenant_id;
