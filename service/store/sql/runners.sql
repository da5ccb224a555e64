-- name: publish_runner
-- A runner says what it can run (tools: name → {version, rerunnable}) and for how long its word
-- holds: at start, and afresh once its row lapsed and it stopped every run the row covered. Its
-- heartbeat (renew_leases) extends live_until in between (claims only read it), so a runner that
-- stops beating drops out by itself, and its row is the lease on all its tasks (lease_lapsed).
INSERT INTO runners (owner, tools, live_until)
VALUES ($1, $2, clock_timestamp() + $3 * interval '1 millisecond')
ON CONFLICT (owner) DO UPDATE
SET tools = excluded.tools, seen_at = clock_timestamp(),
    live_until = excluded.live_until;

-- name: withdraw_runner
-- A runner that stops takes its word back at once.
DELETE FROM runners WHERE owner = $1;

-- name: delete_gone_runners
-- Rows of runners that stopped renewing (killed, cut off): they no longer count.
DELETE FROM runners WHERE live_until < clock_timestamp();

-- name: mark_tasks_without_runner
-- The maintenance pass: a queued task whose tool (at its recorded version) no live runner has is
-- told so in its status message, and the message goes once one has it; its status is untouched
-- (claim_tasks clears the message too). Live: its row renewed within its own bound (a runner that
-- stopped withdrew it; one that died drops out a lease after its last beat). Returns every queued
-- tool with how many of its tasks no live runner can run (0 included, so the gauge falls back).
-- The verdict belongs to a (tool, version), not to a row: it is decided once per pair, and no step
-- joins queued rows with queued rows, so no plan (a young table without statistics, say) can make
-- the pass quadratic in the queue (it took 8 s with 6,400 queued rows on a fresh table when it did).
WITH live AS MATERIALIZED (
    SELECT r.tools FROM runners r WHERE r.live_until > clock_timestamp()
),
verdicts AS MATERIALIZED (
    SELECT g.tool, g.tool_version, g.queued,
           EXISTS (SELECT 1 FROM live
                   WHERE live.tools ? g.tool
                     AND (g.tool_version IS NULL OR live.tools -> g.tool ->> 'version' = g.tool_version)) AS runnable,
           format('queued: no connected worker runs tool %s%s; start one with the tool pack that provides it',
                  quote_literal(g.tool), coalesce(' version ' || quote_literal(g.tool_version), '')) AS waiting
    FROM (SELECT tool, tool_version, count(*) AS queued FROM tasks
          WHERE lease_owner IS NULL AND finished_at IS NULL AND status = 'working' AND expires_at > clock_timestamp()
          GROUP BY tool, tool_version) g
),
-- Rows whose message changes, locked in key order and skipping rows locked elsewhere (a claim, a
-- cancel, another replica's pass): nothing waits, nothing deadlocks; a skipped row is done next pass.
targets AS (
    SELECT t.ctid AS row_id
    FROM tasks t JOIN verdicts v ON v.tool = t.tool AND v.tool_version IS NOT DISTINCT FROM t.tool_version
    WHERE t.lease_owner IS NULL AND t.finished_at IS NULL AND t.status = 'working'
      AND t.expires_at > clock_timestamp()
      AND CASE WHEN v.runnable THEN t.status_message = v.waiting
               ELSE t.status_message IS DISTINCT FROM v.waiting END
    ORDER BY t.tenant_id COLLATE "C", t.task_id COLLATE "C"
    FOR NO KEY UPDATE OF t SKIP LOCKED
),
-- The locked rows by their tuple ids (a TID scan: no join to plan); a row changed since the
-- statement's snapshot is not visible there and waits for the next pass.
changed AS (
    UPDATE tasks t
    SET status_message = CASE WHEN v.runnable THEN NULL ELSE v.waiting END, last_updated_at = clock_timestamp()
    FROM verdicts v
    WHERE t.ctid = ANY (ARRAY(SELECT row_id FROM targets))
      AND v.tool = t.tool AND v.tool_version IS NOT DISTINCT FROM t.tool_version
      AND t.status = 'working' AND t.lease_owner IS NULL
    RETURNING t.task_id
)
SELECT tool, coalesce(sum(queued) FILTER (WHERE NOT runnable), 0)::bigint AS without_runner FROM verdicts GROUP BY tool;

-- name: analyze_stale_tables
-- The maintenance pass, when the server's autovacuum is off: the tables analysed.
SELECT analyze_stale_tables($1::interval) AS analysed;

-- name: analyze_young_tables
-- The maintenance pass, until tasks has statistics: the tables still without, each with whether
-- this call analysed it and its rows changed.
SELECT relname, analysed, changed FROM analyze_young_tables();

-- name: remember_note
-- A run's note for the run after a takeover, written only while the lease is this run's and the
-- task is active; the task's row is locked, so a hand-back or finish cannot come in between.
INSERT INTO task_notes (tenant_id, task_id, note)
SELECT tenant_id, task_id, $5 FROM tasks
WHERE tenant_id = $1 AND task_id = $2 AND lease_owner = $3 AND lease_epoch = $4
  AND status IN ('working', 'input_required')
FOR NO KEY UPDATE
ON CONFLICT (tenant_id, task_id) DO UPDATE SET note = excluded.note, written_at = clock_timestamp()
RETURNING 1;

-- name: recall_note
SELECT note FROM task_notes WHERE tenant_id = $1 AND task_id = $2;

-- name: noted_tasks
-- Which of these tasks ($1 tenants, $2 task ids, pairwise) have a note.
SELECT n.tenant_id, n.task_id FROM task_notes n
JOIN unnest($1::text[], $2::text[]) AS k(tenant_id, task_id) USING (tenant_id, task_id);
