-- name: ask_input
-- A running task is about to ask its client: input_required, only while the runner holds its lease
-- (no row back: cancelled, expired or taken over: another owner or epoch). The row lock orders
-- concurrent questions. A task waiting for input is kept its TTL from its last change.
UPDATE tasks SET status = 'input_required', status_message = 'waiting for input', last_updated_at = clock_timestamp(),
                 expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond'
WHERE tenant_id = $1 AND task_id = $2 AND lease_owner = $3 AND lease_epoch = $4 AND task_status_active(status)
RETURNING task_id;

-- name: insert_question
-- The question, numbered after the task's others (ask_input's row lock is held: no two get one seq).
INSERT INTO task_messages (tenant_id, task_id, seq, input_key, kind, params)
SELECT $1, $2, coalesce(max(seq), 0) + 1, $3, $4, $5
FROM task_messages WHERE tenant_id = $1 AND task_id = $2
RETURNING seq;

-- name: pending_inputs
-- Every unanswered question of an owner's active task, oldest first (the extension's inputRequests).
SELECT m.input_key, m.kind, m.params
FROM task_messages m JOIN tasks t ON t.tenant_id = m.tenant_id AND t.task_id = m.task_id
WHERE m.tenant_id = $1 AND m.task_id = $2 AND t.subject = $3 AND m.answered_at IS NULL
  AND task_status_active(t.status) AND t.expires_at > clock_timestamp()
ORDER BY m.seq;

-- name: claim_undelivered_messages
-- Hand unanswered questions to one stream (no broadcast); stale deliveries are offered again.
UPDATE task_messages
SET delivered_to = $3, delivered_at = clock_timestamp()
WHERE tenant_id = $1 AND task_id = $2 AND answered_at IS NULL
  AND (delivered_to IS NULL
       OR (delivered_to <> $3 AND delivered_at < clock_timestamp() - $4 * interval '1 millisecond'))
RETURNING seq, input_key, kind, params;

-- name: touch_deliveries
-- A live stream keeps its claim on the questions it delivered (they are not stale).
UPDATE task_messages SET delivered_at = clock_timestamp()
WHERE tenant_id = $1 AND delivered_to = $2 AND answered_at IS NULL;

-- name: release_messages
-- A stream closed before its questions were answered: let the next stream take them.
UPDATE task_messages
SET delivered_to = NULL, delivered_at = NULL
WHERE tenant_id = $1 AND delivered_to = $2 AND answered_at IS NULL;

-- name: task_of_input
-- The task a question key belongs to (2025-11-25 answers name the key only).
SELECT task_id FROM task_messages WHERE tenant_id = $1 AND input_key = ANY ($2::text[]) LIMIT 1;

-- name: lock_task_for_answers
-- The task's row first, as ask_input takes it: a question being asked concurrently commits (or
-- not) before the answers count what is left, so none is left open on a working task.
SELECT 1 FROM tasks WHERE tenant_id = $1 AND task_id = $2 AND subject = $3 FOR NO KEY UPDATE;

-- name: lock_outstanding_inputs
-- The questions among keys $4 still open on an active task of subject $2 (of task $3, or found by
-- key when $3 is NULL), locked so the first answer per key wins.
SELECT m.task_id, m.input_key, m.kind
FROM task_messages m JOIN tasks t ON t.tenant_id = m.tenant_id AND t.task_id = m.task_id
WHERE m.tenant_id = $1 AND t.subject = $2 AND ($3::text IS NULL OR m.task_id = $3)
  AND m.input_key = ANY ($4::text[]) AND m.answered_at IS NULL
  AND task_status_active(t.status) AND t.expires_at > clock_timestamp()
ORDER BY m.task_id, m.seq
FOR UPDATE OF m;

-- name: store_answers
-- Record answers ($4, in the order of keys $3); returns how many questions of the task stay open.
WITH answered AS (
    UPDATE task_messages m SET answer = a.answer, answered_at = clock_timestamp()
    FROM unnest($3::text[], $4::jsonb[]) AS a(input_key, answer)
    WHERE m.tenant_id = $1 AND m.task_id = $2 AND m.input_key = a.input_key AND m.answered_at IS NULL
    RETURNING m.input_key
)
SELECT count(*) FROM task_messages
WHERE tenant_id = $1 AND task_id = $2 AND answered_at IS NULL
  AND input_key NOT IN (SELECT input_key FROM answered);

-- name: resume_if_answered
-- No question left open ($3 = 0): the task is working again (XD-10); returns its session.
UPDATE tasks SET status = CASE WHEN $3 = 0 THEN 'working'::task_status ELSE status END,
                 status_message = CASE WHEN $3 = 0 THEN NULL ELSE status_message END,
                 last_updated_at = clock_timestamp(),
                 -- working again: no expiry while it works; still waiting: its TTL from this change
                 expires_at = CASE WHEN $3 = 0 THEN 'infinity'::timestamptz
                                   ELSE clock_timestamp() + ttl_ms * interval '1 millisecond' END
WHERE tenant_id = $1 AND task_id = $2 AND task_status_active(status)
RETURNING session_id;

-- name: get_answer
-- The answer to one question, once it has come.
SELECT answer FROM task_messages
WHERE tenant_id = $1 AND task_id = $2 AND input_key = $3 AND answered_at IS NOT NULL;

-- name: unanswered_for_stream
-- Questions this stream delivered that were never answered (void once the task has ended).
SELECT input_key FROM task_messages
WHERE tenant_id = $1 AND task_id = $2 AND delivered_to = $3 AND answered_at IS NULL
ORDER BY seq;
