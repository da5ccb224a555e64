-- Usage per tenant and tool, read from the audit record (`mcp-tasks usage`, docs/operations.md
-- "Usage per tenant"). A task is created when its `create` row is written and ends at its first
-- terminal row: `complete` (its outcome: completed, tool errors included, or failed), a `cancel`
-- that cancelled, or an `expire` of a task still active when its TTL ran out (an expire row of a
-- finished task is only the clean-up). Plain calls are not in the record: usage_plain_calls has
-- them per hour.

-- name: usage_report
-- Per (tenant, tool): tasks created in [$2, $3), tasks that ended in it by how, and their seconds
-- from create to end; plain calls in the hours (UTC) that [$2, $3) touches; $1 one tenant or all.
-- The create row of a task that ended is looked up over the whole chain (a task may have started
-- before $2), so this reads the tenants' chains up to $3.
WITH events AS (
    SELECT tenant_id, seq, at, action, outcome, task_id, detail
    FROM audit_events
    WHERE ($1::text IS NULL OR tenant_id = $1) AND task_id IS NOT NULL
      AND at < coalesce($3::timestamptz, 'infinity')
      AND action IN ('create', 'complete', 'cancel', 'expire')
),
created AS (
    SELECT tenant_id, task_id, at, coalesce(detail->>'tool', '?') AS tool
    FROM events WHERE action = 'create'
),
ended AS (
    SELECT DISTINCT ON (tenant_id, task_id) tenant_id, task_id, at,
           CASE action WHEN 'complete' THEN outcome WHEN 'cancel' THEN 'cancelled' ELSE 'expired' END AS how
    FROM events
    WHERE action = 'complete' OR (action = 'cancel' AND outcome = 'cancelled')
       OR (action = 'expire' AND outcome IN ('working', 'input_required'))
    ORDER BY tenant_id, task_id, seq
),
created_in_range AS (
    SELECT tenant_id, tool, count(*) AS created
    FROM created WHERE at >= coalesce($2::timestamptz, '-infinity')
    GROUP BY tenant_id, tool
),
ended_in_range AS (
    SELECT e.tenant_id, coalesce(c.tool, '?') AS tool,
           count(*) FILTER (WHERE e.how = 'completed') AS completed,
           count(*) FILTER (WHERE e.how = 'failed') AS failed,
           count(*) FILTER (WHERE e.how = 'cancelled') AS cancelled,
           count(*) FILTER (WHERE e.how = 'expired') AS expired,
           coalesce(sum(extract(epoch FROM e.at - c.at)), 0)::float8 AS task_seconds
    FROM ended e LEFT JOIN created c ON c.tenant_id = e.tenant_id AND c.task_id = e.task_id
    WHERE e.at >= coalesce($2::timestamptz, '-infinity')
    GROUP BY e.tenant_id, coalesce(c.tool, '?')
),
plain_in_range AS (
    SELECT tenant_id, tool, sum(calls)::bigint AS plain_calls
    FROM usage_plain_calls
    WHERE ($1::text IS NULL OR tenant_id = $1)
      AND hour >= date_trunc('hour', coalesce($2::timestamptz, '-infinity'), 'UTC')
      AND hour < coalesce($3::timestamptz, 'infinity')
    GROUP BY tenant_id, tool
)
SELECT tenant_id, tool, coalesce(c.created, 0) AS created, coalesce(e.completed, 0) AS completed,
       coalesce(e.failed, 0) AS failed, coalesce(e.cancelled, 0) AS cancelled, coalesce(e.expired, 0) AS expired,
       coalesce(e.task_seconds, 0) AS task_seconds, coalesce(p.plain_calls, 0) AS plain_calls
FROM created_in_range c FULL JOIN ended_in_range e USING (tenant_id, tool) FULL JOIN plain_in_range p USING (tenant_id, tool)
ORDER BY tenant_id COLLATE "C", tool COLLATE "C";

-- name: usage_add_plain_calls
-- A process's plain calls counted since its last pass, added per (tenant, tool, hour); the rows
-- come sorted by key, so two processes adding to the same rows lock them in one order.
INSERT INTO usage_plain_calls AS u (tenant_id, tool, hour, calls)
SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::bigint[])
ON CONFLICT (tenant_id, tool, hour) DO UPDATE SET calls = u.calls + excluded.calls;
