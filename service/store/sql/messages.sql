-- name: insert_message
-- A request from a running task to its client; seq orders a task's requests.
INSERT INTO task_messages (tenant_id, task_id, seq, rpc_id, method, params)
SELECT $1, $2, coalesce(max(seq), 0) + 1, $3, $4, $5
FROM task_messages WHERE tenant_id = $1 AND task_id = $2
RETURNING seq;

-- name: claim_undelivered_messages
-- Hand unanswered requests to one stream (no broadcast); stale deliveries are offered again.
UPDATE task_messages
SET delivered_to = $3, delivered_at = clock_timestamp()
WHERE tenant_id = $1 AND task_id = $2 AND answered_at IS NULL
  AND (delivered_to IS NULL
       OR (delivered_to <> $3 AND delivered_at < clock_timestamp() - $4 * interval '1 millisecond'))
RETURNING seq, rpc_id, method, params;

-- name: touch_deliveries
-- A live stream keeps its claim on the requests it delivered (they are not stale).
UPDATE task_messages SET delivered_at = clock_timestamp()
WHERE tenant_id = $1 AND delivered_to = $2 AND answered_at IS NULL;

-- name: void_unanswered_messages
-- A task re-queued to run again from the start: its old questions can no longer be answered.
DELETE FROM task_messages WHERE tenant_id = $1 AND task_id = $2 AND answered_at IS NULL;

-- name: release_messages
-- A stream closed before its requests were answered: let the next stream take them.
UPDATE task_messages
SET delivered_to = NULL, delivered_at = NULL
WHERE tenant_id = $1 AND delivered_to = $2 AND answered_at IS NULL;

-- name: answer_message
-- Record the client's answer, only for a request of a task the same subject owns.
UPDATE task_messages m
SET answer = $3, answered_at = clock_timestamp()
FROM tasks t
WHERE m.tenant_id = $1 AND m.rpc_id = $2 AND m.answered_at IS NULL
  AND t.tenant_id = m.tenant_id AND t.task_id = m.task_id AND t.subject = $4
  AND t.status IN ('working', 'input_required') AND t.expires_at > clock_timestamp()
RETURNING m.task_id, m.seq;

-- name: get_answer
-- The answer to one request, once it has come.
SELECT answer FROM task_messages
WHERE tenant_id = $1 AND task_id = $2 AND seq = $3 AND answered_at IS NOT NULL;

-- name: unanswered_for_stream
-- Requests this stream delivered that were never answered (void once the task has ended).
SELECT rpc_id FROM task_messages
WHERE tenant_id = $1 AND task_id = $2 AND delivered_to = $3 AND answered_at IS NULL
ORDER BY seq;
