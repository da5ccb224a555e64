-- name: store_event_payload
-- An event too large for NOTIFY: stored for the receivers, who read it by reference.
INSERT INTO event_payloads (tenant_id, payload) VALUES ($1, $2) RETURNING id;

-- name: get_event_payload
-- An event sent by reference (the tenant is set by the reader's transaction).
SELECT payload FROM event_payloads WHERE tenant_id = current_setting('app.tenant_id', true) AND id = $1;

-- name: delete_old_event_payloads
-- Payloads of events every receiver has had time to read.
DELETE FROM event_payloads WHERE created_at < statement_timestamp() - $1 * interval '1 millisecond';
