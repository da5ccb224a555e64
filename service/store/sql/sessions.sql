-- name: insert_session
-- A new MCP session, bound to the principal that sent initialize.
INSERT INTO sessions (tenant_id, session_id, subject, protocol_version, client_capabilities, client_info)
VALUES ($1, $2, $3, $4, $5, $6);

-- name: trim_sessions
-- A principal keeps its $3 most recently used sessions; older ones end (their clients get 404 and
-- initialize again, H-SESS-5). A bounded delete, not pagination: the OFFSET is the cap.
DELETE FROM sessions
WHERE tenant_id = $1 AND subject = $2 AND session_id IN (
    SELECT session_id FROM sessions WHERE tenant_id = $1 AND subject = $2
    ORDER BY last_seen_at DESC, created_at DESC, session_id DESC
    OFFSET $3
)
RETURNING session_id;

-- name: get_session
-- The session as its owner sees it; another subject's session is not returned.
SELECT session_id, protocol_version, client_capabilities, log_level, last_seen_at,
       extract(epoch FROM clock_timestamp() - last_seen_at) AS idle_s
FROM sessions WHERE tenant_id = $1 AND session_id = $2 AND subject = $3;

-- name: session_capabilities
-- A task of this session is starting: the capabilities its client declared (stored once per session).
SELECT client_capabilities FROM sessions WHERE tenant_id = $1 AND session_id = $2;

-- name: touch_session
-- Keep an active session from being swept as idle.
UPDATE sessions SET last_seen_at = clock_timestamp() WHERE tenant_id = $1 AND session_id = $2;

-- name: delete_session
-- DELETE /mcp: the session ends; its tasks live on (they belong to the principal).
DELETE FROM sessions WHERE tenant_id = $1 AND session_id = $2 AND subject = $3 RETURNING session_id;

-- name: delete_idle_sessions
-- Sessions unused for longer than the idle limit.
-- statement_timestamp(), not clock_timestamp(): a stable bound lets the index on last_seen_at be used.
DELETE FROM sessions WHERE last_seen_at < statement_timestamp() - $1 * interval '1 millisecond';

-- name: set_session_log_level
-- logging/setLevel: the lowest level of log notifications this session wants.
UPDATE sessions SET log_level = $3 WHERE tenant_id = $1 AND session_id = $2;
