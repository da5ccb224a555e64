-- name: publish_upstream_state
-- A process says what it sees of one upstream (its word holds for $4 ms), and rows whose word lapsed
-- an hour ago (processes that were killed) go.
WITH gone AS (
    DELETE FROM upstream_states WHERE live_until < clock_timestamp() - interval '1 hour'
)
INSERT INTO upstream_states (owner, upstream, state, live_until)
VALUES ($1, $2, $3, clock_timestamp() + $4 * interval '1 millisecond')
ON CONFLICT (owner, upstream) DO UPDATE
SET state = excluded.state, seen_at = clock_timestamp(), live_until = excluded.live_until;

-- name: withdraw_upstream_states
-- A process that stops takes its word back.
DELETE FROM upstream_states WHERE owner = $1;

-- name: live_upstream_states
-- What every live process sees of its upstreams, by upstream, then process.
SELECT owner, upstream, state, seen_at
FROM upstream_states
WHERE live_until >= clock_timestamp()
ORDER BY upstream, owner;
