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
SELECT tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool, progress_token, status,
       status_message, outcome, ttl_ms, poll_interval_ms, created_at, last_updated_at, attempts, expires_at
FROM tasks
WHERE tenant_id = $1 AND subject = $2 AND expires_at > clock_timestamp() AND wire = '2025-11-25'
ORDER BY created_at DESC, task_id DESC
LIMIT $3;

-- name: list_tasks_after
-- Next page after the keyset (created_at, task_id) carried by the cursor; the same columns.
SELECT tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool, progress_token, status,
       status_message, outcome, ttl_ms, poll_interval_ms, created_at, last_updated_at, attempts, expires_at
FROM tasks
WHERE tenant_id = $1 AND subject = $2 AND expires_at > clock_timestamp() AND wire = '2025-11-25'
  AND (created_at, task_id) < ($3, $4)
ORDER BY created_at DESC, task_id DESC
LIMIT $5;

-- name: cancel_task
-- Cancel wins: only an active task moves, and its lease is dropped so a late completion finds nothing.
-- Kept its TTL from now (retention after the end).
UPDATE tasks
SET status = 'cancelled', status_message = $4, last_updated_at = clock_timestamp(),
    finished_at = clock_timestamp(), expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond',
    lease_owner = NULL, lease_expires_at = NULL
WHERE tenant_id = $1 AND task_id = $2 AND subject = $3
  AND task_status_active(status) AND expires_at > clock_timestamp()
RETURNING *;

-- name: claim_tasks
-- SKIP LOCKED lets every runner of every replica claim different rows without waiting on each other.
-- Only tasks whose tool this runner has ($4): a fleet whose processes load different tool packs (a
-- rolling deploy adding one, a separate worker pool) leaves a task for a runner that can run it.
-- Fair between tenants, then between a tenant's subjects (docs/decisions.md, "Fair claims"): a
-- tenant holds at most $5 of this process's slots ($6/$7: what each tenant holds here now), so its
-- queued rows are skipped in the index scan once it is at its share (at most the tenant cap of
-- rows to skip); of a window of the oldest other queued rows, the picks go round-robin: each
-- tenant's first (its subjects taking turns, each after the runs it has here already: $9-$11,
-- so one claim cut short, by rows another statement held, is evened out by the next), then each
-- one's second, and so on. A task accepted
-- for a version of its tool waits for that version ($8: tool → version). A "no worker runs tool"
-- message of the maintenance pass (mark_tasks_without_runner) no longer holds. The window is read
-- from tasks_queued by its own conditions, null tests whose statistics the runner role's planner
-- may use: with `status = 'working'` among them it took a queue of thousands for a few rows and
-- sorted a scan of it; the status is checked on the rows picked.
-- A new epoch: a runner that held this task before (even this one) can no longer write its outcome.
-- The claimed tasks' lease is the runner's row too: nothing is claimed by a runner whose row has
-- lapsed (its heartbeat publishes it afresh first). Read, not extended: a claim must not hold the
-- row the heartbeat extends. $2: the tasks' own lease.
UPDATE tasks t
SET lease_owner = $1, lease_expires_at = clock_timestamp() + $2 * interval '1 millisecond',
    attempts = t.attempts + 1, started_at = coalesce(t.started_at, clock_timestamp()),
    lease_epoch = t.lease_epoch + 1, expires_at = 'infinity',  -- started: kept while it works (D-12)
    status_message = CASE WHEN t.status_message LIKE 'queued: no connected worker %' THEN NULL
                          ELSE t.status_message END
FROM (
    SELECT turns.tenant_id, turns.task_id FROM (
        SELECT by_subject.*,
               row_number() OVER (PARTITION BY by_subject.tenant_id
                                  ORDER BY by_subject.subject_turn, by_subject.created_at) AS tenant_turn
        FROM (
            SELECT window_rows.*,
                   row_number() OVER (PARTITION BY window_rows.tenant_id, window_rows.subject
                                      ORDER BY window_rows.created_at)
                   + coalesce((SELECT runs.slots FROM unnest($9::text[], $10::text[], $11::int[])
                                                   AS runs(tenant_id, subject, slots)
                               WHERE runs.tenant_id = window_rows.tenant_id
                                 AND runs.subject = window_rows.subject), 0) AS subject_turn
            FROM (
                SELECT tenant_id, task_id, subject, created_at FROM tasks
                WHERE lease_owner IS NULL AND finished_at IS NULL AND expires_at > clock_timestamp()
                  AND EXISTS (SELECT 1 FROM runners r WHERE r.owner = $1 AND r.live_until > clock_timestamp())
                  AND tool = ANY ($4::text[]) AND (tool_version IS NULL OR tool_version = $8::jsonb ->> tool)
                  AND tenant_id <> ALL (ARRAY(SELECT held.tenant_id FROM unnest($6::text[], $7::int[])
                                                AS held(tenant_id, slots) WHERE held.slots >= $5))
                ORDER BY created_at
                LIMIT 4 * $3
                FOR UPDATE SKIP LOCKED
            ) window_rows
        ) by_subject
    ) turns
    LEFT JOIN unnest($6::text[], $7::int[]) AS held(tenant_id, slots) ON held.tenant_id = turns.tenant_id
    WHERE turns.tenant_turn <= $5 - coalesce(held.slots, 0)
    ORDER BY turns.tenant_turn, turns.created_at
    LIMIT $3
) picked
WHERE t.tenant_id = picked.tenant_id AND t.task_id = picked.task_id AND t.status = 'working'
RETURNING t.*;

-- name: renew_leases
-- The heartbeat (docs/decisions.md, "Fencing"). The runner's row is its lease on every task it
-- runs: extended here ($2) while it still holds, never revived once lapsed (the reaper may have
-- taken its tasks by then; the runner stops its runs and publishes it afresh). The tasks' own
-- leases are long ($6) and extended only for the runs given ($3-$5: those whose lease is a lease
-- old), under the epoch each was given; rows gone, cancelled or taken are not returned. A first row
-- with a NULL task_id says the runner's row was extended; without it nothing was.
-- Rows are locked in (tenant, subject, task) order, as a batch of finishes locks them, and a row
-- locked elsewhere is skipped, not waited for: a transaction left open on one task (an operator's
-- psql, a stuck write) must not hold up the beat of every run, which would fence them all. A
-- skipped row still ours comes back with busy = true: not renewed this beat, not lost either.
WITH runner AS (
    UPDATE runners SET live_until = clock_timestamp() + $2 * interval '1 millisecond', seen_at = clock_timestamp()
    WHERE owner = $1 AND live_until > clock_timestamp()
    RETURNING owner
),
renewed AS (
    UPDATE tasks t
    SET lease_expires_at = clock_timestamp() + $6 * interval '1 millisecond'
    FROM (
        SELECT h.tenant_id, h.task_id FROM tasks h
        JOIN unnest($3::text[], $4::text[], $5::bigint[]) AS running(tenant_id, task_id, epoch)
          ON h.tenant_id = running.tenant_id AND h.task_id = running.task_id
        WHERE EXISTS (SELECT 1 FROM runner)
          AND h.lease_owner = $1 AND h.lease_epoch = running.epoch AND task_status_active(h.status)
        ORDER BY h.tenant_id COLLATE "C", h.subject COLLATE "C", h.task_id COLLATE "C"
        FOR NO KEY UPDATE OF h SKIP LOCKED
    ) held
    WHERE t.tenant_id = held.tenant_id AND t.task_id = held.task_id
    RETURNING t.tenant_id, t.task_id
)
SELECT NULL::text AS tenant_id, NULL::text AS task_id, false AS busy FROM runner
UNION ALL
SELECT tenant_id, task_id, false FROM renewed
UNION ALL
SELECT h.tenant_id, h.task_id, true FROM tasks h
JOIN unnest($3::text[], $4::text[], $5::bigint[]) AS running(tenant_id, task_id, epoch)
  ON h.tenant_id = running.tenant_id AND h.task_id = running.task_id
WHERE EXISTS (SELECT 1 FROM runner)
  AND h.lease_owner = $1 AND h.lease_epoch = running.epoch AND task_status_active(h.status)
  AND NOT EXISTS (SELECT 1 FROM renewed r WHERE r.tenant_id = h.tenant_id AND r.task_id = h.task_id);

-- name: find_lost_leases
-- Leases that lapsed (lease_lapsed: the task's own ran out, or its owner's row did): only then can
-- the owner no longer hold them (it stops its tools before, see docs/decisions.md "Fencing"). Not
-- locked here: task_hand_back re-checks owner, epoch and the lapse under the row lock.
-- A task with a note (task_notes) counts as rerunnable: its tool decides from the note.
SELECT tenant_id, task_id, subject, tool, attempts, lease_owner,
       rerunnable OR EXISTS (SELECT 1 FROM task_notes n WHERE n.tenant_id = t.tenant_id AND n.task_id = t.task_id)
           AS rerunnable,
       lease_epoch
FROM tasks t
WHERE lease_owner IS NOT NULL AND lease_lapsed(lease_owner, lease_expires_at)
ORDER BY lease_expires_at
LIMIT $1;

-- name: lease_state
-- What became of a task after the runner's write was refused (cancelled, gone, or taken over).
SELECT status, lease_owner, lease_epoch FROM tasks WHERE tenant_id = $1 AND task_id = $2;

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
-- per-requestor counters, input_required from its own small partial index, so the
-- cost does not grow with the tasks running; and the bytes every tenant's tasks keep (the storage
-- quota's count).
SELECT (SELECT coalesce(sum(active), 0) FROM active_tasks)::bigint AS active,
       (SELECT count(*) FROM tasks WHERE status = 'input_required') AS input_required,
       (SELECT greatest(coalesce(sum(bytes), 0), 0) FROM active_tasks)::bigint AS bytes;

-- name: task_create
-- Creates in one statement and one commit: one row per item, in order; a row of NULLs where a cap
-- refused the create. Only the columns a Task holds: not the arguments and capabilities a create
-- sent (its request has them), nor the lease times, which no caller reads (the expiry gives the
-- reported ttl, docs/decisions.md D-12).
SELECT tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool, progress_token, status,
       status_message, outcome, payload, ttl_ms, poll_interval_ms, created_at, last_updated_at, attempts,
       rerunnable, lease_epoch, started_at, expires_at, trace_parent
FROM task_create_v3($1);

-- name: task_get
-- Gets in one read-only statement: a row per item found, with its place (o), nothing for an item
-- whose task is unknown, expired or not its subject's.
SELECT o, tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool, progress_token, status,
       status_message, outcome, payload, ttl_ms, poll_interval_ms, created_at, last_updated_at, attempts,
       expires_at, trace_parent
FROM task_get_v2($1, $2, $3);

-- name: task_retrieve
-- Retrieves (gets whose hand-out of a finished result is audited) in one statement: one row per
-- item, in order; a row of NULLs where there is no task.
SELECT tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool, progress_token, status,
       status_message, outcome, payload, ttl_ms, poll_interval_ms, created_at, last_updated_at, attempts,
       rerunnable, lease_epoch, expires_at, trace_parent
FROM task_retrieve_v2($1);

-- name: task_finish
-- Runner outcomes with their audit events and wake-ups in one statement. Not read back: the
-- outcome's payload, the arguments and the client's capabilities, which the runner has.
SELECT tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool, progress_token, status,
       status_message, outcome, ttl_ms, poll_interval_ms, created_at, last_updated_at, attempts, rerunnable,
       lease_epoch, started_at, expires_at
FROM task_finish_v2($1);

-- name: task_hand_back
-- Runners give tasks back (shutdown, lost lease): re-queued or failed, audited, woken.
SELECT * FROM task_hand_back_v2($1);

-- name: queue_by_tool
-- Queued (working, unclaimed) and running (claimed) tasks per tool, with the age of the oldest of
-- each, for the queue gauges. It reads the rows of the two partial indexes only, queued and leased
-- (the sweeper's pass, not a request's; an active task in neither counts in neither), named by
-- their own conditions, null tests, whose statistics the runner role's planner may use.
SELECT tool,
       count(*) FILTER (WHERE lease_owner IS NULL AND status = 'working') AS queued,
       count(*) FILTER (WHERE lease_owner IS NOT NULL) AS running,
       coalesce(extract(epoch FROM clock_timestamp() - min(created_at)
                FILTER (WHERE lease_owner IS NULL AND status = 'working')), 0) AS oldest_queued_s,
       coalesce(extract(epoch FROM clock_timestamp() - min(coalesce(started_at, created_at))
                FILTER (WHERE lease_owner IS NOT NULL)), 0) AS oldest_running_s
FROM tasks
WHERE ((lease_owner IS NULL AND finished_at IS NULL) OR lease_owner IS NOT NULL) AND expires_at > clock_timestamp()
GROUP BY tool;

-- name: active_by_tenant
-- Active tasks and the bytes kept per tenant, from the counters (for the opt-in per-tenant gauges).
SELECT tenant_id, coalesce(sum(active) FILTER (WHERE active > 0), 0)::bigint AS active,
       greatest(sum(bytes), 0)::bigint AS bytes
FROM active_tasks GROUP BY tenant_id;

-- name: note_progress
-- A working task's latest progress report as its status message (2026-07-28: progress
-- notifications reach no one once a call is a task, X-NOTIF-8), only while the run's lease holds;
-- the task's session (if any) for the wake-up.
UPDATE tasks SET status_message = $5, last_updated_at = clock_timestamp()
WHERE tenant_id = $1 AND task_id = $2 AND lease_owner = $3 AND lease_epoch = $4 AND status = 'working'
RETURNING session_id;
