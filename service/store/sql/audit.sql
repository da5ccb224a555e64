-- name: append_audit
-- One event appended to its tenant's SHA-256 chain (the function locks the tenant's head row).
SELECT audit_append($1, $2, $3, $4, $5, $6, $7, $8, $9, $10);

-- name: audit_events
-- Events in chain order for export, optionally one tenant, optionally from a time on, keyset by seq.
SELECT tenant_id, seq, at, action, outcome, subject, client_id, issuer, task_id, request_id, client_address,
       detail, encode(prev_hash, 'hex') AS prev_hash, encode(hash, 'hex') AS hash
FROM audit_events
WHERE ($1::text IS NULL OR tenant_id = $1) AND ($2::timestamptz IS NULL OR at >= $2)
  AND (tenant_id, seq) > ($3, $4)
ORDER BY tenant_id, seq
LIMIT $5;

-- name: audit_chain_problems
-- Every way a chain can be broken: a changed row (hash), a removed or reordered row (seq gap,
-- prev_hash not the previous row's hash), or a removed tail (the head is ahead of the last row).
WITH chain AS (
    SELECT e.tenant_id, e.seq, e.hash, e.prev_hash,
           sha256(e.prev_hash || convert_to(audit_canonical(e), 'UTF8')) AS expected,
           lag(e.seq) OVER w AS prev_seq, lag(e.hash) OVER w AS prev_row_hash
    FROM audit_events e
    WHERE $1::text IS NULL OR e.tenant_id = $1
    WINDOW w AS (PARTITION BY e.tenant_id ORDER BY e.seq)
)
SELECT tenant_id, seq, 'row changed: its hash does not match its content' AS problem
FROM chain WHERE hash <> expected
UNION ALL
SELECT tenant_id, seq, 'row missing before this one (sequence gap)'
FROM chain WHERE seq <> coalesce(prev_seq, 0) + 1
UNION ALL
SELECT tenant_id, seq, 'chain broken: prev_hash is not the previous row''s hash'
FROM chain WHERE prev_hash <> coalesce(prev_row_hash, decode(repeat('00', 32), 'hex'))
UNION ALL
SELECT h.tenant_id, h.seq, 'rows missing at the end (the head is ahead of the last row)'
FROM audit_heads h
WHERE ($1::text IS NULL OR h.tenant_id = $1)
  AND h.seq > coalesce((SELECT max(seq) FROM audit_events e WHERE e.tenant_id = h.tenant_id), 0)
UNION ALL
SELECT e.tenant_id, e.seq, 'row beyond the chain head (appended outside audit_append)'
FROM audit_events e JOIN audit_heads h ON h.tenant_id = e.tenant_id
WHERE ($1::text IS NULL OR e.tenant_id = $1) AND e.seq > h.seq
UNION ALL
SELECT h.tenant_id, h.seq, 'chain head does not match the last row''s hash'
FROM audit_heads h JOIN audit_events e ON e.tenant_id = h.tenant_id AND e.seq = h.seq
WHERE ($1::text IS NULL OR h.tenant_id = $1) AND e.hash <> h.hash
ORDER BY 1, 2;
