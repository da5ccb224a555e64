-- name: get_task
-- One task of one owner; expired rows are invisible even before the sweeper deletes them.
SELECT * FROM tasks
WHERE tenant_id = $1 AND task_id = $2 AND subject = $3 AND expires_at > clock_timestamp();

-- name: get_leased_task
-- An active task leased to this runner (after a create whose answer was lost).
SELECT * FROM tasks
WHERE tenant_id = $1 AND task_id = $2 AND lease_owner = $3 AND status IN ('working', 'input_required');

-- name: list_tasks_first
-- First page of an owner's tasks, newest first.
SELECT * FROM tasks
WHERE tenant_id = $1 AND subject = $2 AND expires_at > clock_timestamp()
ORDER BY created_at DESC, task_id DESC
LIMIT $3;

-- name: list_tasks_after
-- Next page after the keyset (created_at, task_id) carried by the cursor.
SELECT * FROM tasks
WHERE tenant_id = $1 AND subject = $2 AND expires_at > clock_timestamp()
  AND (created_at, task_id) < ($3, $4)
ORDER BY created_at DESC, task_id DESC
LIMIT $5;

-- name: cancel_task
-- Cancel wins: only an active task moves, and its lease is dropped so a late completion finds nothing.
UPDATE tasks
SET status = 'cancelled', status_message = $4, last_updated_at = clock_timestamp(),
    finished_at = clock_timestamp(), lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
WHERE tenant_id = $1 AND task_id = $2 AND subject = $3
  AND status IN ('working', 'input_required') AND expires_at > clock_timestamp()
RETURNING *;

-- name: set_active_status
-- working <-> input_required while the runner holds the lease.
UPDATE tasks
SET status = $4, status_message = $5, last_updated_at = clock_timestamp()
WHERE tenant_id = $1 AND task_id = $2 AND lease_owner = $3 AND status IN ('working', 'input_required')
RETURNING *;

-- name: claim_tasks
-- SKIP LOCKED lets every runner of every replica claim different rows without waiting on each other.
UPDATE tasks t
SET lease_owner = $1, lease_key = $2, lease_expires_at = clock_timestamp() + $3 * interval '1 millisecond',
    attempts = t.attempts + 1, started_at = coalesce(t.started_at, clock_timestamp())
FROM (
    SELECT tenant_id, task_id FROM tasks
    WHERE status = 'working' AND lease_owner IS NULL AND expires_at > clock_timestamp()
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
    WHERE h.lease_owner = $1 AND h.status IN ('working', 'input_required')
    ORDER BY h.tenant_id COLLATE "C", h.subject COLLATE "C", h.task_id COLLATE "C"
    FOR NO KEY UPDATE OF h
) held
WHERE t.tenant_id = held.tenant_id AND t.task_id = held.task_id
RETURNING t.tenant_id, t.task_id;

-- name: find_lost_leases
-- Leases whose time ran out, or whose owner's session-level advisory lock is gone (process died).
SELECT tenant_id, task_id, subject, tool, attempts, lease_owner FROM tasks t
WHERE lease_owner IS NOT NULL
  AND (lease_expires_at < clock_timestamp()
       OR NOT EXISTS (SELECT 1 FROM pg_locks l
                      WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                        AND l.classid::bigint = ((t.lease_key >> 32) & 4294967295)
                        AND l.objid::bigint = (t.lease_key & 4294967295)))
ORDER BY lease_expires_at
LIMIT $1
FOR UPDATE SKIP LOCKED;

-- name: requeue_task
-- A lost task whose tool is safe to re-run goes back to the queue.
UPDATE tasks
SET status = 'working', status_message = $4, last_updated_at = clock_timestamp(),
    lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
WHERE tenant_id = $1 AND task_id = $2 AND lease_owner = $3
RETURNING *;

-- name: fail_lost_task
-- A lost task whose tool is not safe to re-run fails with a protocol error outcome.
UPDATE tasks
SET status = 'failed', outcome = 'rpc_error', payload = $4, status_message = $5,
    last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
    lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
WHERE tenant_id = $1 AND task_id = $2 AND lease_owner = $3
RETURNING *;

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

-- name: create_task_checked
-- The caps under the tenant's create lock, the row, its audit event and the wake-up (migration 0004).
-- No row back: a cap refused it and nothing was written. $19-$21 lease it to a local runner at once.
SELECT * FROM task_create($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18,
                          $19, $20, $21);

-- name: get_task_scoped
-- get_task in one round trip: the function sets the tenant for its own transaction (migration 0004).
SELECT * FROM task_get($1, $2, $3);

-- name: retrieve_task
-- The task, auditing the hand-out of a terminal result in the same statement (migration 0004).
SELECT * FROM task_retrieve($1, $2, $3, $4, $5, $6, $7);

-- name: finish_task_audited
-- finish_task, its audit event and the status wake-up in one statement (migration 0004).
SELECT * FROM task_finish($1, $2, $3, $4, $5, $6, $7, $8);

-- name: task_batch
-- Many creates, gets and retrieves in one statement and one commit (migration 0005): one row per
-- item, in order; a row of NULLs where there is no task.
SELECT * FROM task_batch($1);

-- name: finish_task_batch
-- Many runner outcomes with their audit events and wake-ups in one statement (migration 0005).
SELECT * FROM task_finish_batch($1);
