-- name: publish_runner
-- A runner says what it can run (tools: name → {version, rerunnable}) and for how long its word
-- holds: at start and on every heartbeat, so a runner that stops renewing drops out by itself.
INSERT INTO runners (owner, lease_key, tools, live_until)
VALUES ($1, $2, $3, clock_timestamp() + $4 * interval '1 millisecond')
ON CONFLICT (owner) DO UPDATE
SET lease_key = excluded.lease_key, tools = excluded.tools, seen_at = clock_timestamp(),
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
-- (claim_tasks clears the message too). Live: renewed within its own bound AND its liveness lock
-- held, so a runner that died stops counting at once. Returns every queued tool with how many of
-- its tasks no live runner can run (0 included, so the gauge falls back).
WITH live AS (
    SELECT r.tools FROM runners r
    WHERE r.live_until > clock_timestamp()
      AND EXISTS (SELECT 1 FROM pg_locks l
                  WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                    AND l.classid::bigint = ((r.lease_key >> 32) & 4294967295)
                    AND l.objid::bigint = (r.lease_key & 4294967295))
),
queued AS (
    SELECT t.tenant_id, t.task_id, t.tool, t.status_message,
           format('queued: no connected worker runs tool %s%s; start one with the tool pack that provides it',
                  quote_literal(t.tool), coalesce(' version ' || quote_literal(t.tool_version), '')) AS waiting,
           EXISTS (SELECT 1 FROM live
                   WHERE live.tools ? t.tool
                     AND (t.tool_version IS NULL OR live.tools -> t.tool ->> 'version' = t.tool_version)) AS runnable
    FROM tasks t
    WHERE t.status = 'working' AND t.lease_owner IS NULL AND t.expires_at > clock_timestamp()
),
-- Rows whose message changes, locked in key order and skipping rows locked elsewhere (a claim, a
-- cancel, another replica's pass): nothing waits, nothing deadlocks; a skipped row is done next pass.
targets AS (
    SELECT t.tenant_id, t.task_id, CASE WHEN q.runnable THEN NULL ELSE q.waiting END AS message
    FROM tasks t JOIN queued q ON t.tenant_id = q.tenant_id AND t.task_id = q.task_id
    WHERE CASE WHEN q.runnable THEN q.status_message = q.waiting
               ELSE q.status_message IS DISTINCT FROM q.waiting END
    ORDER BY t.tenant_id COLLATE "C", t.task_id COLLATE "C"
    FOR NO KEY UPDATE OF t SKIP LOCKED
),
changed AS (
    UPDATE tasks t
    SET status_message = g.message, last_updated_at = clock_timestamp()
    FROM targets g
    WHERE t.tenant_id = g.tenant_id AND t.task_id = g.task_id AND t.status = 'working' AND t.lease_owner IS NULL
    RETURNING t.task_id
)
SELECT tool, count(*) FILTER (WHERE NOT runnable) AS without_runner FROM queued GROUP BY tool;
