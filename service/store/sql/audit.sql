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
-- prev_hash not the previous row's hash), a removed tail (the head is ahead of the last row), or a
-- row dated before the one it follows, a purge no export event before it covers. After a purge
-- the first remaining row links to the checkpoint the head keeps (purged_seq, purged_hash).
WITH chain AS (
    SELECT e.tenant_id, e.seq, e.hash, e.prev_hash, e.at,
           sha256(e.prev_hash || convert_to(audit_canonical(e), 'UTF8')) AS expected,
           coalesce(lag(e.seq) OVER w, h.purged_seq, 0) AS prev_seq,
           coalesce(lag(e.hash) OVER w, h.purged_hash, decode(repeat('00', 32), 'hex')) AS prev_row_hash,
           lag(e.at) OVER w AS prev_at
    FROM audit_events e LEFT JOIN audit_heads h ON h.tenant_id = e.tenant_id
    WHERE $1::text IS NULL OR e.tenant_id = $1
    WINDOW w AS (PARTITION BY e.tenant_id ORDER BY e.seq)
)
SELECT tenant_id, seq, 'row changed: its hash does not match its content' AS problem
FROM chain WHERE hash <> expected
UNION ALL
SELECT tenant_id, seq, 'row missing before this one (sequence gap)'
FROM chain WHERE seq <> prev_seq + 1
UNION ALL
SELECT tenant_id, seq, 'chain broken: prev_hash is not the previous row''s hash'
FROM chain WHERE prev_hash <> prev_row_hash
UNION ALL
SELECT tenant_id, seq, 'time goes back: dated before the previous row'
FROM chain WHERE at < prev_at
UNION ALL
SELECT h.tenant_id, h.seq, 'rows missing at the end (the head is ahead of the last row)'
FROM audit_heads h
WHERE ($1::text IS NULL OR h.tenant_id = $1)
  AND h.seq > coalesce((SELECT max(seq) FROM audit_events e WHERE e.tenant_id = h.tenant_id), h.purged_seq)
UNION ALL
SELECT e.tenant_id, e.seq, 'row beyond the chain head (appended outside audit_append)'
FROM audit_events e JOIN audit_heads h ON h.tenant_id = e.tenant_id
WHERE ($1::text IS NULL OR e.tenant_id = $1) AND e.seq > h.seq
UNION ALL
SELECT p.tenant_id, p.seq, 'purge of rows no export covered (through seq ' || (p.detail ->> 'through_seq') || ')'
FROM audit_events p JOIN audit_heads h ON h.tenant_id = p.tenant_id
WHERE ($1::text IS NULL OR p.tenant_id = $1) AND p.action = 'purge' AND p.seq > h.receipts_from_seq
  AND NOT EXISTS (
      SELECT FROM audit_events x
      WHERE x.tenant_id = p.tenant_id AND x.action = 'export' AND x.seq < p.seq
        AND (x.detail ->> 'through_seq')::bigint >= (p.detail ->> 'through_seq')::bigint)
UNION ALL
SELECT h.tenant_id, h.seq, 'chain head does not match the last row''s hash'
FROM audit_heads h JOIN audit_events e ON e.tenant_id = h.tenant_id AND e.seq = h.seq
WHERE ($1::text IS NULL OR h.tenant_id = $1) AND e.hash <> h.hash
ORDER BY 1, 2;

-- name: mark_audit_exported
-- `mcp-tasks audit export` wrote a tenant's chain from its first remaining row up to seq $2 (the
-- export role only; the chain gets an `export` event).
SELECT audit_mark_exported_v2($1, $2);

-- name: audit_purgeable_tenants
-- Tenants with exported events not purged yet (retention), in the order heads are locked everywhere.
SELECT tenant_id FROM audit_heads WHERE exported_seq > purged_seq ORDER BY tenant_id COLLATE "C";

-- name: purge_audit
-- Retention: the tenant's exported events older than $2 go; returns how many (audit_purge).
SELECT audit_purge($1, $2);
