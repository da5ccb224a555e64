"""An audit event's canonical text written directly, byte for byte what the jsonb object gave.

Revision ID: 0020
Revises: 0019

``audit_canonical`` built a ``jsonb`` object of the event's twelve fields and returned its text:
every call converted each field into a jsonb value, sorted the keys, built the object and rendered
it again as text. The chain hashes that text, so it must never
change; the new body writes the same text without the object in between:

- the keys in the order jsonb keeps them (shorter keys first, keys of one length by their bytes):
  ``at``, ``seq``, ``action``, ``detail``, ``issuer``, ``outcome``, ``subject``, ``task_id``,
  ``client_id``, ``tenant_id``, ``request_id``, ``client_address``;
- jsonb's text form: ``{"key": value, ...}``, a space after each colon and comma;
- a string field as ``to_json`` writes it, which escapes with the function jsonb's output uses;
  ``detail`` as its own jsonb text (a nested value is written the same way inside an object);
  ``seq`` as its digits (jsonb renders a number from them); the time in the same ``to_char``
  format, which writes only digits, ``-``, ``T``, ``:``, ``.`` and ``Z`` (nothing to escape);
- ``null`` for a missing value, as jsonb writes SQL NULL.

tests/test_audit_canonical.py checks the two against each other over every field's edge cases
(control characters, quotes, backslashes, non-ASCII text, nested and scalar details, NULLs, the
range of times) and generated text, and that chains written before this revision verify after it
and the other way round.

Per event 6.7 -> 4.7 µs in transactions of 16 events, as the batches make them (5.4 -> 3.0 µs in
one long one); `mcp-tasks audit verify` of 200,000 events 1.8 -> 1.3 s (-27 %). A lifecycle's
PostgreSQL CPU should fall by about 1.5 % (three events), below what ``bench/sql_ab.py`` resolves:
-1.4 % and +0.3 % in two runs (issue 15; docs/performance.md, twenty-second pass).
Replacing the body changes no text, so it may run while the service runs.
"""

from service.store.sqlscript import run_script

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

UPGRADE = """
-- The canonical text of an event, hashed into the chain; also used by `mcp-tasks audit verify`.
-- Existing chains depend on its output: it must never change. It is the text of the jsonb object
-- of the event's fields (migration 0001), written directly (migration 0020): keys in jsonb's order
-- (by length, then bytes), jsonb's spacing, strings escaped by to_json as jsonb escapes them, null
-- for a missing value. PL/pgSQL, not SQL: a SQL function called from PL/pgSQL is parsed and planned
-- again in every transaction.
CREATE OR REPLACE FUNCTION audit_canonical(e audit_events) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN '{"at": ' || coalesce('"' || to_char(e.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') || '"', 'null')
        || ', "seq": ' || coalesce(e.seq::text, 'null')
        || ', "action": ' || coalesce(to_json(e.action)::text, 'null')
        || ', "detail": ' || coalesce(e.detail::text, 'null')
        || ', "issuer": ' || coalesce(to_json(e.issuer)::text, 'null')
        || ', "outcome": ' || coalesce(to_json(e.outcome)::text, 'null')
        || ', "subject": ' || coalesce(to_json(e.subject)::text, 'null')
        || ', "task_id": ' || coalesce(to_json(e.task_id)::text, 'null')
        || ', "client_id": ' || coalesce(to_json(e.client_id)::text, 'null')
        || ', "tenant_id": ' || coalesce(to_json(e.tenant_id)::text, 'null')
        || ', "request_id": ' || coalesce(to_json(e.request_id)::text, 'null')
        || ', "client_address": ' || coalesce(to_json(e.client_address)::text, 'null') || '}';
END
$$;
"""

# 0001's body, as it was written there (indented inside that revision's script).
DOWNGRADE = """
CREATE OR REPLACE FUNCTION audit_canonical(e audit_events) RETURNS text
    LANGUAGE plpgsql IMMUTABLE AS $$
    BEGIN
        RETURN jsonb_build_object(
            'tenant_id', e.tenant_id, 'seq', e.seq,
            'at', to_char(e.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
            'action', e.action, 'outcome', e.outcome, 'subject', e.subject, 'client_id', e.client_id,
            'issuer', e.issuer, 'task_id', e.task_id, 'request_id', e.request_id,
            'client_address', e.client_address, 'detail', e.detail
        )::text;
    END
    $$;
"""


def upgrade() -> None:
    run_script(UPGRADE)


def downgrade() -> None:
    run_script(DOWNGRADE)
