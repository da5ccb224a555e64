-- The current schema of mcp-task-service: the one truth, read top to bottom.
--
-- Migrations (alembic/versions/) are the history, from the baseline of release 0.1.0 on, and
-- never change once committed; this file is what they add up to. tests/test_schema_truth.py
-- builds one database from the migrations and one from this file alone and compares their
-- `pg_dump --schema-only`: change the schema by editing this file AND adding a migration
-- (CONTRIBUTING.md). Grants on alembic_version are the migrations' business and are not repeated
-- here.
--
-- Grouped by aggregate: roles, tasks (with their counters and messages), sessions, service keys,
-- audit, then the hot-path functions that touch several of them.


-- ===================================================================================== roles ==
-- Two NOLOGIN roles, shared by every database of the cluster (so they are created if missing and
-- never dropped, which could break another database):
-- - mcp_tasks_app handles requests: it sees and writes only rows whose tenant_id equals
--   current_setting('app.tenant_id'), set per transaction; no tenant set means no rows.
-- - mcp_tasks_runner claims, reaps and sweeps across tenants.
-- The service's login user is a member of both and acts as one of them per connection pool (the
-- `role` startup parameter). Policies apply to members of a role too, so every all-tenants policy
-- also requires current_user to be the runner role: a login user that merely inherits it sees
-- nothing. FORCE ROW LEVEL SECURITY makes the policies apply to the tables' owner too.
-- The runner role's read `(CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT
-- NULL`, which is that comparison as the planner should see it: a comparison
-- without a column is estimated to hold for 0.5 % of rows, so every scan of the role was planned
-- for 1/200 of its rows (a backlog's claim sorted a scan of the queue on disk instead of reading
-- the queue's index in order); a null test of an expression is estimated to hold for 99.5 %. The
-- record role's keep the comparison: its lookups by key cost more planned the other way.
-- A third NOLOGIN role, mcp_tasks_record, owns the functions that write the record (the audit
-- chain, task outcomes); the login user is never a member of it, so the service's credentials
-- reach the record only through those functions (SECURITY.md: what the credentials can do).
-- A fourth, mcp_tasks_exporter, is the export path's (`mcp-tasks audit export` with a login of its
-- own): the only role that may say how far a chain was written out, which is what lets a purge
-- remove rows. The service's login is never a member of it.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mcp_tasks_app') THEN
        CREATE ROLE mcp_tasks_app NOLOGIN NOBYPASSRLS;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mcp_tasks_runner') THEN
        CREATE ROLE mcp_tasks_runner NOLOGIN NOBYPASSRLS;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mcp_tasks_record') THEN
        CREATE ROLE mcp_tasks_record NOLOGIN NOBYPASSRLS;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mcp_tasks_exporter') THEN
        CREATE ROLE mcp_tasks_exporter NOLOGIN NOBYPASSRLS;
    END IF;
END
$$;
GRANT USAGE ON SCHEMA public TO mcp_tasks_app, mcp_tasks_runner, mcp_tasks_record, mcp_tasks_exporter;
-- Nobody but the owner creates in public: an object the service's login created
-- there could stand in for a built-in that a SECURITY DEFINER function calls. Where the migrating
-- role may not revoke it (PostgreSQL 14's public is the bootstrap superuser's), the service warns.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
-- The schema owner hands functions to mcp_tasks_record: it must be able to act as that role (a
-- superuser can; a CREATEROLE owner grants itself membership), and the role may own objects here.
DO $$
BEGIN
    IF NOT pg_has_role(current_user, 'mcp_tasks_record', 'MEMBER') THEN
        EXECUTE format('GRANT mcp_tasks_record TO %I', current_user);
    END IF;
END
$$;
GRANT CREATE ON SCHEMA public TO mcp_tasks_record;

-- A closed event bus: only the service's roles may connect to its database (so LISTEN, NOTIFY and
-- advisory locks are theirs alone), and nobody may create temporary tables.
DO $$
BEGIN
    EXECUTE format('REVOKE CONNECT, TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO mcp_tasks_app, mcp_tasks_runner, mcp_tasks_exporter',
                   current_database());
END
$$;


-- ===================================================================================== tasks ==
CREATE TYPE task_status AS ENUM ('working', 'input_required', 'completed', 'failed', 'cancelled');

-- "Active" (working or input_required) is decided here and only here.
CREATE FUNCTION task_status_active(s task_status) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN s IN ('working', 'input_required');

-- One row per task. Every key starts with tenant_id so the table can be distributed by it.
CREATE TABLE tasks (
    tenant_id           text        NOT NULL,
    task_id             text        NOT NULL,
    subject             text        NOT NULL,
    issuer              text        NOT NULL DEFAULT '',
    client_id           text        NOT NULL DEFAULT '',
    session_id          text,
    wire                text        NOT NULL,
    tool                text        NOT NULL,
    arguments           jsonb       NOT NULL,
    client_capabilities jsonb       NOT NULL DEFAULT '{}',
    progress_token      jsonb,
    status              task_status NOT NULL DEFAULT 'working',
    status_message      text,
    outcome             text,
    payload             jsonb,
    ttl_ms              bigint      NOT NULL,
    poll_interval_ms    integer     NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_updated_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at          timestamptz NOT NULL,
    started_at          timestamptz,
    finished_at         timestamptz,
    lease_owner         text,
    lease_expires_at    timestamptz,
    attempts            integer     NOT NULL DEFAULT 0,
    -- Whether the tool may run again after a lost run, and the version of the tool the task was
    -- accepted for (NULL: unversioned), both as the accepting process's registry said at create:
    -- the reaper decides from the row, not from its own (perhaps different) tool packs.
    rerunnable          boolean     NOT NULL DEFAULT false,
    tool_version        text,
    -- The fencing token is (lease_owner, lease_epoch): the epoch grows whenever the lease changes
    -- hands (a claim, a hand-back), and a runner's finish, release, renewal and questions act only
    -- while both still match what it was given (docs/decisions.md, "Fencing").
    lease_epoch         bigint      NOT NULL DEFAULT 0,
    -- The bytes of what the client chose (arguments, capabilities, progress token) and of the result:
    -- what the tenant's storage quota counts (see "the tenant's storage quota" below).
    stored_bytes        bigint      NOT NULL DEFAULT 0,
    -- The creating request's W3C traceparent (issue 44): a task's run, in whichever process, is a
    -- child of the request that created it, and later requests link to it. NULL: not traced.
    trace_parent        text,
    CONSTRAINT tasks_pkey PRIMARY KEY (tenant_id, task_id),
    CONSTRAINT tasks_wire_known CHECK (wire IN ('2025-11-25', '2026-07-28')),
    CONSTRAINT tasks_ttl_positive CHECK (ttl_ms > 0),
    CONSTRAINT tasks_lease_complete CHECK ((lease_owner IS NULL) = (lease_expires_at IS NULL)),
    -- One stored outcome, rendered per wire: a tool error is a completed call (its result says
    -- so), and only a call that failed is failed.
    CONSTRAINT tasks_outcome_matches_status CHECK (
           (status = 'completed' AND outcome IN ('result', 'tool_error') AND payload IS NOT NULL)
        OR (status = 'failed' AND outcome = 'failure' AND payload IS NOT NULL)
        OR (status IN ('working', 'input_required', 'cancelled') AND outcome IS NULL AND payload IS NULL)
    ),
    CONSTRAINT tasks_lease_only_while_active CHECK (
        lease_owner IS NULL OR task_status_active(status)
    ),
    CONSTRAINT tasks_stored_bytes_nonnegative CHECK (stored_bytes >= 0),
    CONSTRAINT tasks_trace_parent_short CHECK (octet_length(trace_parent) <= 128)
);
-- Runners claim from here: the queue, unclaimed and unfinished rows, oldest first. They are the
-- working ones: a task asks for input only while a runner holds it, and every hand-back makes it
-- working again (task_hand_back). Null tests only, because they call no operator: row-level
-- security applies to the service's roles, and under it the planner may not use a column's
-- statistics with an operator that is not leakproof, as the enum's `=` is not: `status =
-- 'working'` was estimated from the column's count of distinct values alone, so in a table of
-- finished tasks the queue looked like half of it, or all, and a large table was scanned instead.
CREATE INDEX tasks_queued ON tasks (created_at) WHERE lease_owner IS NULL AND finished_at IS NULL;
-- The reaper scans leases that may have lapsed.
CREATE INDEX tasks_leased ON tasks (lease_expires_at) WHERE lease_owner IS NOT NULL;
-- tasks/list keyset pagination, newest first.
CREATE INDEX tasks_owner_recent ON tasks (tenant_id, subject, created_at DESC, task_id DESC);
-- (No index of active tasks per requestor: the caps read the active_tasks counters, the queue
-- gauges the two partial indexes above.)
-- The sweeper deletes by expiry.
CREATE INDEX tasks_expiry ON tasks (expires_at);
-- The tasks_active gauge counts input_required tasks here (the active total comes from the
-- counters): a count over every active task's row grew with the tasks running.
CREATE INDEX tasks_input_required ON tasks (tenant_id) WHERE status = 'input_required';

GRANT SELECT, INSERT, DELETE ON tasks TO mcp_tasks_app, mcp_tasks_runner;
-- Task outcomes: written only through task_finish and task_hand_back (which check the lease and
-- run as mcp_tasks_record). The service's roles update only the columns their statements set; a
-- task is inserted working, and deleted only once expired.
GRANT UPDATE (status, status_message, last_updated_at, finished_at, lease_owner, lease_expires_at, expires_at)
    ON tasks TO mcp_tasks_app;
GRANT UPDATE (status, status_message, last_updated_at, lease_owner, lease_expires_at, attempts,
              started_at, lease_epoch, expires_at)
    ON tasks TO mcp_tasks_runner;
CREATE POLICY tasks_inserted_working ON tasks AS RESTRICTIVE FOR INSERT TO mcp_tasks_app, mcp_tasks_runner
    WITH CHECK (status = 'working' AND outcome IS NULL AND payload IS NULL AND finished_at IS NULL);
CREATE POLICY tasks_deleted_expired ON tasks AS RESTRICTIVE FOR DELETE TO mcp_tasks_app, mcp_tasks_runner
    USING (expires_at <= clock_timestamp());
-- A finished task is not changed by the service's roles at all (nor locked for update), until it
-- has expired and the sweeper deletes it.
CREATE POLICY tasks_finished_unchanged ON tasks AS RESTRICTIVE FOR UPDATE TO mcp_tasks_app, mcp_tasks_runner
    USING (task_status_active(status) OR expires_at <= clock_timestamp()) WITH CHECK (true);
GRANT SELECT, UPDATE ON tasks TO mcp_tasks_record;
ALTER TABLE tasks ENABLE ROW LEVEL SECURITY;
ALTER TABLE tasks FORCE ROW LEVEL SECURITY;
CREATE POLICY tasks_tenant_isolation ON tasks TO mcp_tasks_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY tasks_runner_all_tenants ON tasks TO mcp_tasks_runner
    USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL) WITH CHECK (current_user = 'mcp_tasks_runner');
CREATE POLICY tasks_record ON tasks TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');

-- Active (working or input_required) tasks per requestor, kept by the triggers below, so the caps
-- read counters instead of counting a tenant's active tasks on every create. The tenant's total
-- is the sum over its requestors with active tasks; the sweeper drops zero rows. An active task
-- whose TTL ran out counts until the sweeper deletes it (one sweep interval).
CREATE TABLE active_tasks (
    tenant_id text   NOT NULL,
    subject   text   NOT NULL,
    active    bigint NOT NULL,
    -- The stored_bytes of the requestor's tasks (active or not): the storage quota's count.
    bytes     bigint NOT NULL DEFAULT 0,
    -- No CHECK (active >= 0): the delete trigger applies decrements as INSERT ... ON CONFLICT DO
    -- UPDATE with a negative value, and a CHECK is evaluated on the proposed row first.
    CONSTRAINT active_tasks_pkey PRIMARY KEY (tenant_id, subject)
);

-- Every writer locks counter rows before the tenant's audit head, and a statement that changes
-- several requestors' tasks locks their counters in (tenant, subject) order, so counters never
-- close a deadlock cycle. Statement triggers count: each sums its statement's rows per requestor
-- and applies the sums in that order, so a batch changes a requestor's counter once, not once per
-- task (issue 15, point 2: a row changed 32 times in one transaction left 32 row versions that
-- every later change and read walked through). A batch inserts one requestor's run of creates per
-- statement and finishes all its tasks with one UPDATE; the sweeper deletes in batches.
-- Counters are locked in code point order everywhere (the service sorts in Python, which
-- compares code points): the database's collation could order "Bob" and "alice" otherwise.
CREATE FUNCTION tasks_count_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO active_tasks (tenant_id, subject, active, bytes)
    SELECT tenant_id, subject, count(*) FILTER (WHERE task_status_active(status)), sum(stored_bytes)
    FROM new_rows
    GROUP BY tenant_id, subject
    HAVING count(*) FILTER (WHERE task_status_active(status)) <> 0 OR sum(stored_bytes) <> 0
    ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
    ON CONFLICT (tenant_id, subject) DO UPDATE
        SET active = active_tasks.active + excluded.active, bytes = active_tasks.bytes + excluded.bytes;
    RETURN NULL;
END
$$;
CREATE FUNCTION tasks_count_updated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO active_tasks (tenant_id, subject, active, bytes)
    SELECT tenant_id, subject, sum(d), sum(b) FROM (
        SELECT tenant_id, subject, CASE WHEN task_status_active(status) THEN 1 ELSE 0 END AS d,
               stored_bytes AS b
        FROM new_rows
        UNION ALL
        SELECT tenant_id, subject, CASE WHEN task_status_active(status) THEN -1 ELSE 0 END AS d,
               -stored_bytes AS b
        FROM old_rows
    ) changed
    GROUP BY tenant_id, subject HAVING sum(d) <> 0 OR sum(b) <> 0
    ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
    ON CONFLICT (tenant_id, subject) DO UPDATE
        SET active = active_tasks.active + excluded.active, bytes = active_tasks.bytes + excluded.bytes;
    RETURN NULL;
END
$$;
CREATE FUNCTION tasks_count_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO active_tasks (tenant_id, subject, active, bytes)
    SELECT tenant_id, subject, -count(*) FILTER (WHERE task_status_active(status)), -sum(stored_bytes)
    FROM old_rows
    GROUP BY tenant_id, subject
    HAVING count(*) FILTER (WHERE task_status_active(status)) <> 0 OR sum(stored_bytes) <> 0
    ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
    ON CONFLICT (tenant_id, subject) DO UPDATE
        SET active = active_tasks.active + excluded.active, bytes = active_tasks.bytes + excluded.bytes;
    RETURN NULL;
END
$$;
CREATE TRIGGER tasks_count_inserted AFTER INSERT ON tasks REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tasks_count_inserted();
CREATE TRIGGER tasks_count_updated AFTER UPDATE ON tasks REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tasks_count_updated();
CREATE TRIGGER tasks_count_deleted AFTER DELETE ON tasks REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tasks_count_deleted();

GRANT SELECT, INSERT, UPDATE, DELETE ON active_tasks TO mcp_tasks_app, mcp_tasks_runner;
GRANT SELECT, INSERT, UPDATE ON active_tasks TO mcp_tasks_record;
ALTER TABLE active_tasks ENABLE ROW LEVEL SECURITY;
ALTER TABLE active_tasks FORCE ROW LEVEL SECURITY;
CREATE POLICY active_tasks_tenant_isolation ON active_tasks TO mcp_tasks_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY active_tasks_runner_all_tenants ON active_tasks TO mcp_tasks_runner
    USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL) WITH CHECK (current_user = 'mcp_tasks_runner');
CREATE POLICY active_tasks_record ON active_tasks TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');

-- Questions a task asks its client and the client's answers, wire-neutral: a key (unique for the
-- task's life and the tenant), the kind of question and its own fields; the answer is
-- {"result": ...} or {"error": ...}.
CREATE TABLE task_messages (
    tenant_id    text        NOT NULL,
    task_id      text        NOT NULL,
    seq          integer     NOT NULL,
    input_key    text        NOT NULL,
    kind         text        NOT NULL,
    params       jsonb       NOT NULL,
    delivered_to text,
    delivered_at timestamptz,
    answer       jsonb,
    answered_at  timestamptz,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT task_messages_pkey PRIMARY KEY (tenant_id, task_id, seq),
    CONSTRAINT task_messages_task_fkey FOREIGN KEY (tenant_id, task_id)
        REFERENCES tasks (tenant_id, task_id) ON DELETE CASCADE,
    CONSTRAINT task_messages_input_key_unique UNIQUE (tenant_id, input_key),
    CONSTRAINT task_messages_answer_complete CHECK ((answer IS NULL) = (answered_at IS NULL)),
    CONSTRAINT task_messages_kind_known CHECK (kind IN ('elicitation', 'sampling', 'roots'))
);

GRANT SELECT, INSERT, UPDATE, DELETE ON task_messages TO mcp_tasks_app, mcp_tasks_runner;
GRANT SELECT, DELETE ON task_messages TO mcp_tasks_record;
ALTER TABLE task_messages ENABLE ROW LEVEL SECURITY;
ALTER TABLE task_messages FORCE ROW LEVEL SECURITY;
CREATE POLICY task_messages_tenant_isolation ON task_messages TO mcp_tasks_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY task_messages_runner_all_tenants ON task_messages TO mcp_tasks_runner
    USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL) WITH CHECK (current_user = 'mcp_tasks_runner');
CREATE POLICY task_messages_record ON task_messages TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');


-- ================================================================================== sessions ==
-- MCP sessions (2025-11-25). A session is bound to the principal that opened it.
CREATE TABLE sessions (
    tenant_id           text        NOT NULL,
    session_id          text        NOT NULL,
    subject             text        NOT NULL,
    protocol_version    text        NOT NULL,
    client_capabilities jsonb       NOT NULL DEFAULT '{}',
    client_info         jsonb,
    log_level           text,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_seen_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT sessions_pkey PRIMARY KEY (tenant_id, session_id),
    CONSTRAINT sessions_log_level_known CHECK (log_level IN
        ('debug', 'info', 'notice', 'warning', 'error', 'critical', 'alert', 'emergency'))
);
CREATE INDEX sessions_idle ON sessions (last_seen_at);
-- The session cap keeps each principal's most recently used sessions (issue 14 #4).
CREATE INDEX sessions_owner_recent ON sessions (tenant_id, subject, last_seen_at DESC);

GRANT SELECT, INSERT, UPDATE, DELETE ON sessions TO mcp_tasks_app, mcp_tasks_runner;
ALTER TABLE sessions ENABLE ROW LEVEL SECURITY;
ALTER TABLE sessions FORCE ROW LEVEL SECURITY;
CREATE POLICY sessions_tenant_isolation ON sessions TO mcp_tasks_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY sessions_runner_all_tenants ON sessions TO mcp_tasks_runner
    USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL) WITH CHECK (current_user = 'mcp_tasks_runner');


-- ============================================================================ event payloads ==
-- Events too large for NOTIFY travel by reference (service/store/events.py); kept a minute.
CREATE TABLE event_payloads (
    tenant_id  text        NOT NULL,
    id         bigint      GENERATED ALWAYS AS IDENTITY,
    payload    jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT event_payloads_pkey PRIMARY KEY (tenant_id, id)
);
CREATE INDEX event_payloads_age ON event_payloads (created_at);
GRANT SELECT, INSERT, DELETE ON event_payloads TO mcp_tasks_app, mcp_tasks_runner;
ALTER TABLE event_payloads ENABLE ROW LEVEL SECURITY;
ALTER TABLE event_payloads FORCE ROW LEVEL SECURITY;
CREATE POLICY event_payloads_tenant_isolation ON event_payloads TO mcp_tasks_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY event_payloads_runner_all_tenants ON event_payloads TO mcp_tasks_runner
    USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL) WITH CHECK (current_user = 'mcp_tasks_runner');

-- =================================================================================== runners ==
-- What each runner process can run, so a task whose tool no live runner has is told so (the
-- maintenance pass sets its status message) and counted (mcp_tasks_tasks_without_runner). A runner
-- upserts its row at start (and afresh after it lapsed), saying how long its word holds
-- (live_until); every heartbeat extends live_until while the row still holds (a lapsed row is not
-- revived by a beat, see lease_lapsed), and it deletes the row when it stops. The row is also the
-- lease on all of the runner's tasks. Not tenant data: only the runner role sees it.
-- tools: {"<name>": {"version": <text or null>, "rerunnable": <bool>}, ...}
CREATE TABLE runners (
    owner       text        NOT NULL,
    tools       jsonb       NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    seen_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    live_until  timestamptz NOT NULL,
    CONSTRAINT runners_pkey PRIMARY KEY (owner),
    CONSTRAINT runners_tools_object CHECK (jsonb_typeof(tools) = 'object')
);

GRANT SELECT, INSERT, UPDATE, DELETE ON runners TO mcp_tasks_runner;
ALTER TABLE runners ENABLE ROW LEVEL SECURITY;
ALTER TABLE runners FORCE ROW LEVEL SECURITY;
CREATE POLICY runners_runner_only ON runners TO mcp_tasks_runner
    USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL) WITH CHECK (current_user = 'mcp_tasks_runner');

-- The release function (owned by mcp_tasks_record) reads whether a lease's owner is live.
GRANT SELECT ON runners TO mcp_tasks_record;
CREATE POLICY runners_record_reads ON runners FOR SELECT TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record');

-- Has a task's lease lapsed, so that the reaper may take it (docs/decisions.md, "Fencing")? A lease
-- holds while both hold: the task's own (long) lease_expires_at, which a runner renews only now and
-- then, and its owner's row in runners, which the runner's heartbeat renews for all its tasks at
-- once. So a dead or cut-off runner's tasks lapse with its row (a lease's time after its last
-- heartbeat), and a task a live runner no longer runs (a claim whose answer was lost) with its own
-- lease. The one rule: the reaper's search (find_lost_leases) and task_hand_back's re-check under
-- the row lock both call it. SQL, so a query that calls it has it inlined.
CREATE FUNCTION lease_lapsed(p_owner text, p_expires_at timestamptz) RETURNS boolean
LANGUAGE sql VOLATILE
RETURN p_expires_at < clock_timestamp()
    OR NOT EXISTS (SELECT 1 FROM runners r WHERE r.owner = p_owner AND r.live_until > clock_timestamp());


-- ============================================================================== service keys ==
-- Server-wide secrets shared by all replicas (e.g. the tasks/list cursor key); not per tenant.
CREATE TABLE service_keys (
    name       text        NOT NULL,
    secret     bytea       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT service_keys_pkey PRIMARY KEY (name),
    CONSTRAINT service_keys_secret_long CHECK (octet_length(secret) >= 32)
);

GRANT SELECT, INSERT ON service_keys TO mcp_tasks_app, mcp_tasks_runner;


-- ===================================================================================== audit ==
-- Audit events: append-only, one SHA-256 hash chain per tenant. Each row's hash is
-- sha256(prev_hash || canonical(row)), where canonical(row) is the jsonb text of the row's fields
-- (jsonb text output is deterministic: sorted keys, fixed formatting; times are rendered in UTC).
-- audit_heads holds each tenant's last seq and hash; appending locks that row, so a tenant's
-- events are numbered without gaps even with many replicas. The service's roles may only SELECT
-- events and heads and call audit_append_events (the one implementation of the chain step, run as
-- mcp_tasks_record: it takes the time itself, never earlier than the chain's last event, and
-- computes the hash) or audit_append (one event, through it). A trigger refuses UPDATE and
-- TRUNCATE for everyone, and DELETE to all but audit_purge (retention).
CREATE TABLE audit_events (
    tenant_id      text        NOT NULL,
    seq            bigint      NOT NULL,
    at             timestamptz NOT NULL DEFAULT clock_timestamp(),
    action         text        NOT NULL,
    outcome        text        NOT NULL,
    subject        text        NOT NULL DEFAULT '',
    client_id      text        NOT NULL DEFAULT '',
    issuer         text        NOT NULL DEFAULT '',
    task_id        text,
    request_id     text,
    client_address text,
    detail         jsonb,
    prev_hash      bytea       NOT NULL,
    hash           bytea       NOT NULL,
    CONSTRAINT audit_events_pkey PRIMARY KEY (tenant_id, seq),
    CONSTRAINT audit_events_action_known CHECK (action IN
        ('create', 'complete', 'retrieve', 'cancel', 'input', 'expire', 'deny', 'requeue', 'purge', 'export')),
    CONSTRAINT audit_events_seq_positive CHECK (seq > 0),
    CONSTRAINT audit_events_hash_size CHECK (octet_length(hash) = 32 AND octet_length(prev_hash) = 32)
);
-- An export from a time on (`mcp-tasks audit export --since`): times grow with the chain, so a
-- block range index is enough and costs an insert next to nothing.
CREATE INDEX audit_events_at ON audit_events USING brin (at);

-- Besides the last seq and hash: the time of the last event (no event is dated before it), how
-- far `mcp-tasks audit export` has read the chain from its start (exported_seq), and the last row
-- a purge removed (purged_seq, purged_hash: the checkpoint the first remaining row links to), and
-- from which seq on every purge must follow an `export` event that covers it (receipts_from_seq:
-- `mcp-tasks audit verify` checks it; a chain older than the export events starts at its head).
CREATE TABLE audit_heads (
    tenant_id    text        NOT NULL,
    seq          bigint      NOT NULL,
    hash         bytea       NOT NULL,
    at           timestamptz,
    exported_seq bigint      NOT NULL DEFAULT 0,
    purged_seq   bigint      NOT NULL DEFAULT 0,
    purged_hash  bytea       NOT NULL DEFAULT decode(repeat('00', 32), 'hex'),
    receipts_from_seq bigint NOT NULL DEFAULT 0,
    CONSTRAINT audit_heads_pkey PRIMARY KEY (tenant_id),
    CONSTRAINT audit_heads_purged_after_export CHECK (purged_seq <= exported_seq AND exported_seq <= seq)
);

-- When each requestor was last audited retrieving a finished task, and how often since: repeated
-- retrievals are recorded once per interval (docs/decisions.md). Gone with the task: no foreign
-- key (its lock and check cost a first retrieval more than the rest of it), but the
-- statement trigger below deletes the rows of the tasks a statement deleted.
CREATE TABLE audit_retrievals (
    tenant_id  text        NOT NULL,
    task_id    text        NOT NULL,
    subject    text        NOT NULL,
    audited_at timestamptz NOT NULL,
    repeats    bigint      NOT NULL DEFAULT 0,
    CONSTRAINT audit_retrievals_pkey PRIMARY KEY (tenant_id, task_id, subject)
);
GRANT SELECT, INSERT, UPDATE, DELETE ON audit_retrievals TO mcp_tasks_record;
ALTER TABLE audit_retrievals ENABLE ROW LEVEL SECURITY;
ALTER TABLE audit_retrievals FORCE ROW LEVEL SECURITY;
CREATE POLICY audit_retrievals_record ON audit_retrievals TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');

-- A deleted task's retrieval rows go with it, deleted as mcp_tasks_record (the only role that may).
CREATE FUNCTION tasks_forget_retrievals() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
BEGIN
    DELETE FROM audit_retrievals r USING old_rows o WHERE r.tenant_id = o.tenant_id AND r.task_id = o.task_id;
    RETURN NULL;
END
$$;
ALTER FUNCTION tasks_forget_retrievals() OWNER TO mcp_tasks_record;
REVOKE ALL ON FUNCTION tasks_forget_retrievals() FROM PUBLIC;
CREATE TRIGGER tasks_forget_retrievals AFTER DELETE ON tasks REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tasks_forget_retrievals();

-- The canonical text of an event, hashed into the chain; also used by `mcp-tasks audit verify`.
-- Existing chains depend on its output: it must never change. It is the text of the jsonb object
-- of the event's fields, written directly: keys in jsonb's order
-- (by length, then bytes), jsonb's spacing, strings escaped by to_json as jsonb escapes them, null
-- for a missing value. PL/pgSQL, not SQL: a SQL function called from PL/pgSQL is parsed and planned
-- again in every transaction.
CREATE FUNCTION audit_canonical(e audit_events) RETURNS text
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

-- A finished task's result handed out again is recorded once per requestor per interval, the
-- repeats counted into the next event (docs/decisions.md). Returns NULL when this
-- hand-out is only counted, else how many were counted since the last recorded one. A first
-- hand-out inserts the requestor's row; else that row, locked, decides. Called
-- only by the record's own functions.
CREATE FUNCTION audit_retrieval_due(p_tenant text, p_task_id text, p_subject text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    every_s double precision :=
        coalesce(nullif(current_setting('mcp_tasks.audit_retrieve_interval_s', true), ''), '3600')::double precision;
    seen audit_retrievals;
BEGIN
    IF every_s <= 0 THEN
        RETURN 0;
    END IF;
    -- A first hand-out inserts the requestor's row and is recorded; else the row decides, locked
    -- (an insert under way in another transaction is waited for by the INSERT).
    INSERT INTO audit_retrievals (tenant_id, task_id, subject, audited_at, repeats)
    VALUES (p_tenant, p_task_id, p_subject, clock_timestamp(), 0)
    ON CONFLICT (tenant_id, task_id, subject) DO NOTHING;
    IF FOUND THEN
        RETURN 0;
    END IF;
    SELECT * INTO seen FROM audit_retrievals
    WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject FOR UPDATE;
    IF NOT FOUND THEN  -- deleted with its task meanwhile: this hand-out is recorded
        RETURN 0;
    END IF;
    IF seen.audited_at > clock_timestamp() - every_s * interval '1 second' THEN
        UPDATE audit_retrievals SET repeats = repeats + 1
        WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject;
        RETURN NULL;
    END IF;
    UPDATE audit_retrievals SET audited_at = clock_timestamp(), repeats = 0
    WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject;
    RETURN seen.repeats;
END
$$;
ALTER FUNCTION audit_retrieval_due(text, text, text) OWNER TO mcp_tasks_record;

-- One event to append to a chain: everything but its tenant, its place and its hash.
CREATE TYPE audit_event_item AS (
    action text, outcome text, subject text, client_id text, issuer text, task_id text,
    request_id text, client_address text, detail jsonb
);

-- Append events to their tenants' chains, p_tenants[i] being the tenant of p_events[i]: the one
-- implementation of the chain step. Each tenant's events go onto its chain in their order, each
-- with the next seq, a time never earlier than the chain's last event, and
-- sha256(prev_hash || canonical(row)). A finished task's result handed out again is recorded once
-- per requestor per interval (audit_retrieval_due), decided before any head is locked. Locks: a
-- tenant's missing head is made before any head is locked, then the heads are locked in tenant
-- order (COLLATE "C"), as every writer takes them (one tenant's events, as every request appends,
-- lock that head by key). The request role appends only to its
-- transaction's tenant's chain (row-level security held it there; this runs as the record's
-- owner); the runner role appends for any tenant (expiries, finishes, hand-backs). Returns the last
-- event's seq, NULL when every event was a retrieval only counted.
CREATE FUNCTION audit_append_events(p_tenants text[], p_events audit_event_item[]) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    n integer := coalesce(cardinality(p_events), 0);
    kept_tenants text[] := '{}';
    kept audit_event_item[] := '{}';
    m integer := 0;
    ev audit_event_item;
    repeats bigint;
    tenants text[];
    at_order integer[];
    head_tenant text[];
    head_seq bigint[];
    head_hash bytea[];
    head_at timestamptz[];
    head audit_heads;
    e audit_events;
    chain audit_events[] := '{}';
    h integer := 0;
    k integer;
BEGIN
    IF cardinality(p_tenants) IS DISTINCT FROM n OR array_position(p_tenants, NULL) IS NOT NULL
       OR (n > 0 AND (array_lower(p_tenants, 1) <> 1 OR array_lower(p_events, 1) <> 1)) THEN
        RAISE EXCEPTION 'audit_append_events: one tenant for every event' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF current_setting('role') = 'mcp_tasks_app'
       AND NOT coalesce(current_setting('app.tenant_id', true) = ALL (p_tenants), false) THEN
        RAISE EXCEPTION 'audit_append_events: not the transaction''s tenant' USING ERRCODE = 'insufficient_privilege';
    END IF;
    FOR i IN 1 .. n LOOP
        ev := p_events[i];
        ev.subject := coalesce(ev.subject, '');
        IF ev.action = 'retrieve' AND ev.task_id IS NOT NULL THEN
            repeats := audit_retrieval_due(p_tenants[i], ev.task_id, ev.subject);
            CONTINUE WHEN repeats IS NULL;
            IF repeats > 0 THEN
                ev.detail := coalesce(ev.detail, '{}') || jsonb_build_object('repeats_before', repeats);
            END IF;
        END IF;
        m := m + 1;
        kept_tenants[m] := p_tenants[i];
        kept[m] := ev;
    END LOOP;
    IF m = 0 THEN
        RETURN NULL;
    END IF;
    IF kept_tenants[1] = ALL (kept_tenants) THEN  -- one tenant (every request's append): its head by key
        SELECT * INTO head FROM audit_heads WHERE tenant_id = kept_tenants[1] FOR UPDATE;
        IF NOT FOUND THEN  -- the tenant's first event
            INSERT INTO audit_heads (tenant_id, seq, hash) VALUES (kept_tenants[1], 0, decode(repeat('00', 32), 'hex'))
                ON CONFLICT (tenant_id) DO NOTHING;
            SELECT * INTO head FROM audit_heads WHERE tenant_id = kept_tenants[1] FOR UPDATE;
        END IF;
        at_order := array(SELECT generate_series(1, m));
        head_tenant := ARRAY[head.tenant_id]; head_seq := ARRAY[head.seq];
        head_hash := ARRAY[head.hash]; head_at := ARRAY[head.at];
    ELSE
        -- The events by tenant (in tenant order), each tenant's in their order; the tenants in order.
        SELECT array_agg(x.o ORDER BY x.t COLLATE "C", x.o), array_agg(DISTINCT x.t COLLATE "C" ORDER BY x.t COLLATE "C")
            INTO at_order, tenants
        FROM unnest(kept_tenants) WITH ORDINALITY AS x(t, o);
        -- A tenant's first event: its head is made before any head is locked, in tenant order.
        IF (SELECT count(*) FROM audit_heads WHERE tenant_id = ANY (tenants)) < cardinality(tenants) THEN
            INSERT INTO audit_heads (tenant_id, seq, hash)
            SELECT t, 0, decode(repeat('00', 32), 'hex') FROM unnest(tenants) AS t ORDER BY t COLLATE "C"
            ON CONFLICT (tenant_id) DO NOTHING;
        END IF;
        -- The heads, locked in tenant order (rows are locked as the sort returns them), read field by
        -- field: a row array would be converted through text, its time by the session's DateStyle.
        SELECT array_agg(l.tenant_id ORDER BY l.tenant_id COLLATE "C"), array_agg(l.seq ORDER BY l.tenant_id COLLATE "C"),
               array_agg(l.hash ORDER BY l.tenant_id COLLATE "C"), array_agg(l.at ORDER BY l.tenant_id COLLATE "C")
            INTO head_tenant, head_seq, head_hash, head_at
        FROM (SELECT tenant_id, seq, hash, at FROM audit_heads WHERE tenant_id = ANY (tenants)
              ORDER BY tenant_id COLLATE "C" FOR UPDATE) l;
    END IF;
    -- The chain step, for every event.
    FOREACH k IN ARRAY at_order LOOP
        IF h = 0 OR e.tenant_id <> kept_tenants[k] THEN  -- the next tenant's chain
            IF h > 0 THEN
                head_seq[h] := e.seq; head_hash[h] := e.hash; head_at[h] := e.at;
            END IF;
            h := h + 1;
            IF head_tenant[h] IS DISTINCT FROM kept_tenants[k] THEN  -- never append to another chain
                RAISE EXCEPTION 'audit_append_events: no head for tenant %', kept_tenants[k];
            END IF;
            e.tenant_id := head_tenant[h]; e.seq := head_seq[h]; e.hash := head_hash[h]; e.at := head_at[h];
        END IF;
        ev := kept[k];
        e.seq := e.seq + 1; e.at := greatest(clock_timestamp(), e.at);
        e.action := ev.action; e.outcome := ev.outcome;
        e.subject := ev.subject; e.client_id := coalesce(ev.client_id, '');
        e.issuer := coalesce(ev.issuer, ''); e.task_id := ev.task_id; e.request_id := ev.request_id;
        e.client_address := ev.client_address; e.detail := ev.detail; e.prev_hash := e.hash;
        e.hash := sha256(e.prev_hash || convert_to(audit_canonical(e), 'UTF8'));
        chain[cardinality(chain) + 1] := e;
    END LOOP;
    head_seq[h] := e.seq; head_hash[h] := e.hash; head_at[h] := e.at;
    IF m = 1 THEN  -- one event: inserted as a row (cheaper than unnest of one)
        INSERT INTO audit_events VALUES (e.*);
    ELSE
        INSERT INTO audit_events SELECT * FROM unnest(chain);
    END IF;
    IF h = 1 THEN
        UPDATE audit_heads SET seq = e.seq, hash = e.hash, at = e.at WHERE tenant_id = e.tenant_id;
    ELSE
        -- Each head by key (ANY), whatever plan a join of the heads with an array would get.
        UPDATE audit_heads
        SET seq = head_seq[array_position(head_tenant, tenant_id)], hash = head_hash[array_position(head_tenant, tenant_id)],
            at = head_at[array_position(head_tenant, tenant_id)]
        WHERE tenant_id = ANY (head_tenant);
    END IF;
    RETURN e.seq;
END
$$;
ALTER FUNCTION audit_append_events(text[], audit_event_item[]) OWNER TO mcp_tasks_record;

-- One event (the shape every single writer uses): audit_append_events of one.
CREATE FUNCTION audit_append(
    p_tenant text, p_action text, p_outcome text, p_subject text, p_client_id text, p_issuer text,
    p_task_id text, p_request_id text, p_client_address text, p_detail jsonb
) RETURNS bigint
LANGUAGE sql
RETURN audit_append_events(ARRAY[p_tenant], ARRAY[ROW(p_action, p_outcome, p_subject, p_client_id, p_issuer,
                                                      p_task_id, p_request_id, p_client_address,
                                                      p_detail)::audit_event_item]);
ALTER FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb) OWNER TO mcp_tasks_record;

-- `mcp-tasks audit export` read a tenant's chain from its start up to p_seq: those rows may be purged.
CREATE FUNCTION audit_mark_exported(p_tenant text, p_seq bigint) RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, public
BEGIN ATOMIC
    UPDATE audit_heads SET exported_seq = greatest(exported_seq, least(p_seq, seq))
    WHERE tenant_id = p_tenant
    RETURNING exported_seq;
END;
ALTER FUNCTION audit_mark_exported(text, bigint) OWNER TO mcp_tasks_record;

-- The export path wrote a tenant's chain from its start up to p_seq: those rows may be purged,
-- and the chain says so (an `export` event naming how far, and the login that exported).
CREATE FUNCTION audit_mark_exported_v2(p_tenant text, p_seq bigint) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    was bigint;
    now_at bigint;
BEGIN
    SELECT exported_seq INTO was FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    UPDATE audit_heads SET exported_seq = greatest(exported_seq, least(p_seq, seq))
    WHERE tenant_id = p_tenant
    RETURNING exported_seq INTO now_at;
    IF now_at > was THEN
        PERFORM audit_append(p_tenant, 'export', 'ok', '', '', '', NULL, NULL, NULL,
                             jsonb_build_object('through_seq', now_at, 'login', session_user::text));
    END IF;
    RETURN now_at;
END
$$;
ALTER FUNCTION audit_mark_exported_v2(text, bigint) OWNER TO mcp_tasks_record;

-- Retention: a tenant's exported events older than p_before go. The chain stays verifiable: the
-- head keeps the last purged row's seq and hash (the next row links to it), and the purge itself
-- is an event of the chain.
CREATE FUNCTION audit_purge(p_tenant text, p_before timestamptz) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    head audit_heads;
    last_gone audit_events;
    removed bigint;
BEGIN
    SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    SELECT * INTO last_gone FROM audit_events
    WHERE tenant_id = p_tenant AND seq > head.purged_seq AND seq <= head.exported_seq AND at < p_before
    ORDER BY seq DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    DELETE FROM audit_events WHERE tenant_id = p_tenant AND seq <= last_gone.seq;
    GET DIAGNOSTICS removed = ROW_COUNT;
    UPDATE audit_heads SET purged_seq = last_gone.seq, purged_hash = last_gone.hash WHERE tenant_id = p_tenant;
    PERFORM audit_append(p_tenant, 'purge', 'ok', '', '', '', NULL, NULL, NULL,
                         jsonb_build_object('through_seq', last_gone.seq, 'rows', removed,
                                            'before', to_char(p_before AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')));
    RETURN removed;
END
$$;
ALTER FUNCTION audit_purge(text, timestamptz) OWNER TO mcp_tasks_record;


CREATE FUNCTION audit_events_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_user = 'mcp_tasks_record' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'audit_events is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$;
CREATE TRIGGER audit_events_no_update_delete BEFORE UPDATE OR DELETE ON audit_events
    FOR EACH ROW EXECUTE FUNCTION audit_events_append_only();
CREATE TRIGGER audit_events_no_truncate BEFORE TRUNCATE ON audit_events
    FOR EACH STATEMENT EXECUTE FUNCTION audit_events_append_only();

GRANT SELECT ON audit_events, audit_heads TO mcp_tasks_app, mcp_tasks_runner;
GRANT SELECT, INSERT, DELETE ON audit_events TO mcp_tasks_record;
GRANT SELECT, INSERT, UPDATE ON audit_heads TO mcp_tasks_record;
REVOKE ALL ON FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb),
    audit_append_events(text[], audit_event_item[]), audit_retrieval_due(text, text, text),
    audit_mark_exported(text, bigint), audit_purge(text, timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb),
    audit_append_events(text[], audit_event_item[]), audit_canonical(audit_events) TO mcp_tasks_app, mcp_tasks_runner;
GRANT USAGE ON TYPE audit_event_item TO mcp_tasks_app, mcp_tasks_runner;
-- The runner purges (retention) only what an export covered; only the export path marks it so.
GRANT EXECUTE ON FUNCTION audit_purge(text, timestamptz) TO mcp_tasks_runner;
REVOKE ALL ON FUNCTION audit_mark_exported_v2(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION audit_mark_exported_v2(text, bigint), audit_purge(text, timestamptz)
    TO mcp_tasks_exporter;
GRANT SELECT ON audit_events, audit_heads TO mcp_tasks_exporter;

ALTER TABLE audit_events ENABLE ROW LEVEL SECURITY;
ALTER TABLE audit_events FORCE ROW LEVEL SECURITY;
CREATE POLICY audit_events_tenant_isolation ON audit_events TO mcp_tasks_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY audit_events_runner_all_tenants ON audit_events TO mcp_tasks_runner
    USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL) WITH CHECK (current_user = 'mcp_tasks_runner');
ALTER TABLE audit_heads ENABLE ROW LEVEL SECURITY;
ALTER TABLE audit_heads FORCE ROW LEVEL SECURITY;
CREATE POLICY audit_heads_tenant_isolation ON audit_heads TO mcp_tasks_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY audit_heads_runner_all_tenants ON audit_heads TO mcp_tasks_runner
    USING ((CASE WHEN current_user = 'mcp_tasks_runner' THEN true END) IS NOT NULL) WITH CHECK (current_user = 'mcp_tasks_runner');
CREATE POLICY audit_events_record ON audit_events TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');
CREATE POLICY audit_heads_record ON audit_heads TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record') WITH CHECK (current_user = 'mcp_tasks_record');
CREATE POLICY audit_events_exporter_all_tenants ON audit_events TO mcp_tasks_exporter
    USING (current_user = 'mcp_tasks_exporter');
CREATE POLICY audit_heads_exporter_all_tenants ON audit_heads TO mcp_tasks_exporter
    USING (current_user = 'mcp_tasks_exporter');


-- ============================================================================ hot paths ==
-- One function per operation, each taking a batch (service/store/batch.py: the requests that
-- arrive while one statement is in flight go together in the next), so under load a round trip, a
-- statement and a durable commit serve many requests, and the listening replicas are woken once
-- per commit. A single request is a batch of one: one implementation per operation. The
-- operation's name is the same from the wire to here: create, get, retrieve (app role), finish and
-- hand back (runner role).
--
-- Locks are taken in the order every other writer takes them, so batches deadlock neither with
-- each other nor with single statements: the tenants' create locks (sorted), then the tasks' rows,
-- then their requestors' counters in (tenant, subject, task) order (the caller sorts the batch; a
-- finish or hand-back locks all its rows before it changes any), then the tenants' audit heads, in
-- tenant order. Every such order compares code points (COLLATE "C", as Python sorts), whatever
-- the database's collation. Each item of the request role sets its own tenant before it touches a
-- table, so row-level security applies per item exactly as it would to a statement of its own.
--
-- The results come back one row per item, in the order of the items; a row of NULLs means "no
-- task": a cap refused the create, the task is unknown, expired or someone else's, or its lease is
-- no longer the caller's.

-- One create: the task, its requestor and the caps it is checked against, and (lease_owner) the
-- runner of the creating process when the task goes straight to a free slot of it.
CREATE TYPE task_create_item AS (
    tenant_id text, task_id text, subject text, issuer text, client_id text, session_id text,
    wire text, tool text, arguments jsonb, client_capabilities jsonb, progress_token jsonb,
    ttl_ms bigint, poll_interval_ms integer, max_per_requestor bigint, max_per_tenant bigint,
    request_id text, client_address text, detail jsonb,
    lease_owner text, lease_ms bigint, rerunnable boolean, tool_version text, max_tenant_bytes bigint,
    trace_parent text
);

-- Creates, each under its tenant's create lock with the caps counted (the counters, plus the
-- tenant's creates ahead of it in the batch), a tenant's creates inserted by one statement, each
-- audited, the unleased ones announced to the runners ('created').
CREATE FUNCTION task_create(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_create_item[];
    it task_create_item;
    found_tasks tasks[];
    lock_tenant text;
    mine bigint;
    total bigint;
    counted_tenant text;
    counted_subject text;
    n integer;
    -- The current tenant's creates that passed the caps, not inserted yet, and their places.
    pending task_create_item[] := '{}';
    pending_at integer[] := '{}';
    pending_ids text[] := '{}';
    pending_tenant text;
    t tasks;
    inserted tasks[];
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_create_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    -- The create locks of every tenant of the batch, in tenant order, held until commit.
    FOR lock_tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || lock_tenant, 0));
    END LOOP;
    -- The rows, in the caller's (tenant, subject, task) order. A tenant's creates go in as one
    -- INSERT when the next tenant's first create comes (or the items end: the extra pass), so the
    -- counter trigger (a statement trigger) changes each requestor's counter once, not once per
    -- task. Row-level security checks every row against the tenant set for the INSERT: its own.
    FOR i IN 1 .. n + 1 LOOP
        IF cardinality(pending) > 0 AND (i > n OR items[i].tenant_id IS DISTINCT FROM pending_tenant) THEN
            PERFORM set_config('app.tenant_id', pending_tenant, true);
            IF cardinality(pending) = 1 THEN  -- one create of this tenant: a plain INSERT costs less
                it := pending[1];
                INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool,
                                   arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                   expires_at, lease_owner, lease_expires_at, attempts, started_at,
                                   rerunnable, tool_version)
                VALUES (it.tenant_id, it.task_id, it.subject, it.issuer, it.client_id, it.session_id, it.wire,
                        it.tool, it.arguments, it.client_capabilities, it.progress_token, it.ttl_ms,
                        it.poll_interval_ms, clock_timestamp() + it.ttl_ms * interval '1 millisecond',
                        it.lease_owner, clock_timestamp() + it.lease_ms * interval '1 millisecond',
                        CASE WHEN it.lease_owner IS NULL THEN 0 ELSE 1 END,
                        CASE WHEN it.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                        it.rerunnable, it.tool_version)
                RETURNING * INTO t;
                found_tasks[pending_at[1]] := t;
            ELSE
            WITH ins AS (
                INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool,
                                   arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                   expires_at, lease_owner, lease_expires_at, attempts, started_at,
                                   rerunnable, tool_version)
                SELECT p.tenant_id, p.task_id, p.subject, p.issuer, p.client_id, p.session_id, p.wire,
                       p.tool, p.arguments, p.client_capabilities, p.progress_token, p.ttl_ms,
                       p.poll_interval_ms, clock_timestamp() + p.ttl_ms * interval '1 millisecond',
                       p.lease_owner, clock_timestamp() + p.lease_ms * interval '1 millisecond',
                       CASE WHEN p.lease_owner IS NULL THEN 0 ELSE 1 END,
                       CASE WHEN p.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                       p.rerunnable, p.tool_version
                FROM unnest(pending) p
                RETURNING *
            )
            SELECT array_agg(ROW(ins.*)::tasks ORDER BY w.o) INTO inserted
            FROM ins JOIN unnest(pending_ids) WITH ORDINALITY AS w(task_id, o) ON w.task_id = ins.task_id;
            FOR j IN 1 .. cardinality(pending_at) LOOP
                found_tasks[pending_at[j]] := inserted[j];
            END LOOP;
            END IF;
            pending := '{}';
            pending_at := '{}';
            pending_ids := '{}';
        END IF;
        EXIT WHEN i > n;
        it := items[i];
        PERFORM set_config('app.tenant_id', it.tenant_id, true);
        -- The counters are read once per run of one requestor's creates (the batch is sorted), plus
        -- this tenant's creates not inserted yet, and counted on here: the tenant's create lock
        -- keeps other creates out, a finish committed meanwhile only lowers them.
        IF counted_tenant IS DISTINCT FROM it.tenant_id OR counted_subject IS DISTINCT FROM it.subject THEN
            SELECT coalesce(sum(active) FILTER (WHERE subject = it.subject), 0), coalesce(sum(active), 0)
                INTO mine, total
            FROM active_tasks WHERE tenant_id = it.tenant_id AND active > 0;
            total := total + cardinality(pending);
            mine := mine + (SELECT count(*) FROM unnest(pending) p WHERE p.subject = it.subject);
            counted_tenant := it.tenant_id;
            counted_subject := it.subject;
        END IF;
        IF mine < it.max_per_requestor AND total < it.max_per_tenant THEN
            pending_tenant := it.tenant_id;
            pending[cardinality(pending) + 1] := it;
            pending_at[cardinality(pending_at) + 1] := i;
            pending_ids[cardinality(pending_ids) + 1] := it.task_id;
            mine := mine + 1;  -- as the counter trigger will
            total := total + 1;
        END IF;
    END LOOP;
    -- Then the audit events, appended per tenant in tenant order (audit heads after counters, as
    -- every writer), under that tenant; the unleased tasks announced.
    FOR lock_tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
        PERFORM set_config('app.tenant_id', lock_tenant, true);
        PERFORM audit_append_events(array_agg(lock_tenant), array_agg(
                    ROW('create', 'working', x.subject, x.client_id, x.issuer, x.task_id, x.request_id,
                        x.client_address, x.detail)::audit_event_item ORDER BY x.ordinality))
        FROM unnest(items) WITH ORDINALITY AS x
        WHERE x.tenant_id = lock_tenant AND (found_tasks[x.ordinality]).task_id IS NOT NULL
        HAVING count(*) > 0;
    END LOOP;
    FOR i IN 1 .. n LOOP
        IF (found_tasks[i]).task_id IS NOT NULL AND items[i].lease_owner IS NULL THEN
            PERFORM pg_notify('mcp_tasks', json_build_object(
                'v', 1, 'k', 'created', 'tenant_id', items[i].tenant_id, 'task_id', items[i].task_id)::text);
        END IF;
        RETURN NEXT found_tasks[i];
    END LOOP;
END
$$;

-- Gets: one set-based read per tenant of the batch, under that tenant's row-level security, each
-- row by primary key; a row per item found (its place in ``o``), nothing for the others.
CREATE FUNCTION task_get(p_tenants text[], p_task_ids text[], p_subjects text[])
RETURNS TABLE (o integer, tenant_id text, task_id text, subject text, issuer text, client_id text,
               session_id text, wire text, tool text, progress_token jsonb, status task_status,
               status_message text, outcome text, payload jsonb, ttl_ms bigint, poll_interval_ms integer,
               created_at timestamptz, last_updated_at timestamptz, attempts integer, expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    tenant text;
BEGIN
    -- Each item's row by primary key alone (a subquery kept whole by OFFSET 0: with the subject
    -- among its conditions the planner may walk tasks_owner_recent, every task of the subject),
    -- then kept when it is the item's subject's and unexpired, with the item's place.
    FOR tenant IN SELECT DISTINCT u FROM unnest(p_tenants) AS u LOOP
        PERFORM set_config('app.tenant_id', tenant, true);
        RETURN QUERY
        SELECT w.o::integer, t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.wire,
               t.tool, t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
               t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at
        FROM unnest(p_tenants, p_task_ids, p_subjects) WITH ORDINALITY AS w(tenant_id, task_id, subject, o)
        CROSS JOIN LATERAL (
            SELECT k.tenant_id, k.task_id, k.subject, k.issuer, k.client_id, k.session_id, k.wire, k.tool,
                   k.progress_token, k.status, k.status_message, k.outcome, k.payload, k.ttl_ms,
                   k.poll_interval_ms, k.created_at, k.last_updated_at, k.attempts, k.expires_at
            FROM tasks k
            WHERE k.tenant_id = w.tenant_id AND k.task_id = w.task_id
            OFFSET 0
        ) t
        WHERE w.tenant_id = tenant AND t.subject = w.subject AND t.expires_at > clock_timestamp();
    END LOOP;
END
$$;

-- One retrieve (2025-11-25 tasks/result): the requestor and where the request came from.
CREATE TYPE task_retrieve_item AS (
    tenant_id text, task_id text, subject text, issuer text, client_id text, request_id text, client_address text
);

-- Retrieves: gets whose hand-out of a finished task's result is audited (once per requestor per
-- interval, audit_append_events), in the same statement and commit.
CREATE FUNCTION task_retrieve(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_retrieve_item[];
    it task_retrieve_item;
    found_tasks tasks[];
    t tasks;
    tenant text;
    n integer;
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_retrieve_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    FOR i IN 1 .. n LOOP
        it := items[i];
        t := NULL;
        PERFORM set_config('app.tenant_id', it.tenant_id, true);
        -- Only what a lookup answers with (not the arguments nor the client's capabilities), by
        -- primary key alone, then the owner and the expiry checked here (as task_get).
        SELECT tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool, progress_token,
               status, status_message, outcome, payload, ttl_ms, poll_interval_ms, created_at,
               last_updated_at, attempts, expires_at
        INTO t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.wire, t.tool,
             t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
             t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at
        FROM tasks
        WHERE tenant_id = it.tenant_id AND task_id = it.task_id;
        IF t.task_id IS NOT NULL AND (t.subject <> it.subject OR NOT t.expires_at > clock_timestamp()) THEN
            t := NULL;
        END IF;
        found_tasks[i] := t;
    END LOOP;
    -- The hand-outs of finished tasks, appended per tenant in tenant order, under that tenant.
    FOR tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
        PERFORM set_config('app.tenant_id', tenant, true);
        PERFORM audit_append_events(array_agg(tenant), array_agg(
                    ROW('retrieve', (found_tasks[x.ordinality]).status::text, x.subject, x.client_id, x.issuer,
                        x.task_id, x.request_id, x.client_address, NULL)::audit_event_item ORDER BY x.ordinality))
        FROM unnest(items) WITH ORDINALITY AS x
        WHERE x.tenant_id = tenant AND (found_tasks[x.ordinality]).task_id IS NOT NULL
          AND NOT task_status_active((found_tasks[x.ordinality]).status)
        HAVING count(*) > 0;
    END LOOP;
    FOR i IN 1 .. n LOOP
        RETURN NEXT found_tasks[i];
    END LOOP;
END
$$;

-- One runner outcome, under the fencing token (owner, epoch) the run was given.
CREATE TYPE task_finish_item AS (
    tenant_id text, task_id text, owner text, status task_status, outcome text, payload jsonb,
    status_message text, detail jsonb, epoch bigint
);

-- Finishes: each task whose lease (owner and epoch) the item still holds gets its outcome, an
-- audit event ('complete') and a wake-up ('status'); the others are left alone (a row of NULLs).
CREATE FUNCTION task_finish(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_finish_item[];
    done_tasks tasks[] := '{}';
    done tasks;
    done_list tasks[];
    done_at bigint[];
    n integer;
    events audit_event_item[] := '{}';
    event_tenants text[] := '{}';
    n_events integer := 0;
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_finish_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    -- Every row first, in the caller's (tenant, subject, task) order, before any counter: a
    -- cancel locks its row before that requestor's counter. One statement for them all: each
    -- item's row by primary key, locked in the items' order (a lateral lookup per item, in the
    -- order unnest gives them; a join could be planned, and cached, as a scan of the table).
    PERFORM 1 FROM unnest(items) WITH ORDINALITY AS u
    CROSS JOIN LATERAL (SELECT 1 FROM tasks k WHERE k.tenant_id = u.tenant_id AND k.task_id = u.task_id
                        FOR NO KEY UPDATE) l;
    -- Then one UPDATE for them all, each row under its own lease check, so the counter trigger
    -- changes each requestor's counter once for the batch. The rows are locked already: the join
    -- order does not matter. A task named twice is finished once (the first the join meets).
    WITH finished AS (
        UPDATE tasks t
        SET status = u.status, outcome = u.outcome, payload = u.payload, status_message = u.status_message,
            last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
            lease_owner = NULL, lease_expires_at = NULL
        FROM unnest(items) WITH ORDINALITY AS u
        WHERE t.tenant_id = u.tenant_id AND t.task_id = u.task_id AND t.lease_owner = u.owner
          AND t.lease_epoch = u.epoch AND task_status_active(t.status)
        RETURNING t AS done_row, u.ordinality AS pos
    )
    SELECT array_agg(f.done_row ORDER BY f.pos), array_agg(f.pos ORDER BY f.pos) INTO done_list, done_at FROM finished f;
    FOR j IN 1 .. coalesce(cardinality(done_at), 0) LOOP
        done_tasks[done_at[j]] := done_list[j];
    END LOOP;
    -- The audit events in item order, appended by one call for all their tenants.
    FOR i IN 1 .. n LOOP
        done := done_tasks[i];
        CONTINUE WHEN done.task_id IS NULL;
        n_events := n_events + 1;
        event_tenants[n_events] := done.tenant_id;
        events[n_events] := ROW('complete', done.status::text, done.subject, done.client_id, done.issuer,
                                done.task_id, NULL, NULL, items[i].detail)::audit_event_item;
        PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', done.tenant_id,
                                                         'task_id', done.task_id, 'session_id', done.session_id)::text);
    END LOOP;
    IF n_events > 0 THEN
        PERFORM audit_append_events(event_tenants, events);
    END IF;
    FOR i IN 1 .. n LOOP
        RETURN NEXT done_tasks[i];
    END LOOP;
END
$$;

-- One task a runner gives back (it stopped, or the reaper found its lease lapsed): run it again
-- if its tool may re-run and attempts remain, else fail it. epoch: the lease_epoch the caller saw;
-- only_if_lapsed: the reaper's, which acts only on a lease that lapsed (lease_lapsed).
CREATE TYPE task_hand_back_item AS (
    tenant_id text, task_id text, owner text, rerunnable boolean, max_attempts integer,
    requeue_message text, failure jsonb, epoch bigint, only_if_lapsed boolean
);

-- Hand-backs: the one path for the reaper and a stopping runner alike; rows locked first in the
-- caller's order, as finishes lock them. Each re-queue ('requeue') and failure ('complete') is
-- audited, re-queued tasks are announced ('created') and every change wakes its waiters ('status').
CREATE FUNCTION task_hand_back(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_hand_back_item[];
    it task_hand_back_item;
    moved tasks[];
    requeued boolean[];
    t tasks;
    n integer;
    events audit_event_item[] := '{}';
    event_tenants text[] := '{}';
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_hand_back_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    PERFORM 1 FROM unnest(items) WITH ORDINALITY AS u
    CROSS JOIN LATERAL (SELECT 1 FROM tasks k WHERE k.tenant_id = u.tenant_id AND k.task_id = u.task_id
                        FOR NO KEY UPDATE) l;
    FOR i IN 1 .. n LOOP
        it := items[i];
        t := NULL;
        requeued[i] := false;
        UPDATE tasks
        SET status = 'working', status_message = format('%s (attempt %s)', it.requeue_message, attempts + 1),
            last_updated_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL,
            lease_epoch = lease_epoch + 1
        WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
          AND lease_epoch = it.epoch
          AND (it.only_if_lapsed IS NOT TRUE OR lease_lapsed(lease_owner, lease_expires_at))
          AND task_status_active(status) AND it.rerunnable AND attempts < it.max_attempts
        RETURNING * INTO t;
        IF t.task_id IS NOT NULL THEN
            requeued[i] := true;
            -- Its questions were asked by the run that stopped: they can no longer be answered.
            DELETE FROM task_messages WHERE tenant_id = it.tenant_id AND task_id = it.task_id
                AND answered_at IS NULL;
        ELSE
            UPDATE tasks
            SET status = 'failed', outcome = 'failure', payload = it.failure,
                status_message = it.failure ->> 'message',
                last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
                lease_owner = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
              AND lease_epoch = it.epoch
              AND (it.only_if_lapsed IS NOT TRUE OR lease_lapsed(lease_owner, lease_expires_at))
              AND task_status_active(status)
            RETURNING * INTO t;
        END IF;
        moved[i] := t;
    END LOOP;
    FOR i IN 1 .. n LOOP
        t := moved[i];
        CONTINUE WHEN t.task_id IS NULL;
        event_tenants := event_tenants || t.tenant_id;
        IF requeued[i] THEN
            events := events || ROW('requeue', 'working', t.subject, t.client_id, t.issuer, t.task_id, NULL, NULL,
                                    jsonb_build_object('attempt', t.attempts + 1, 'owner', items[i].owner))::audit_event_item;
            PERFORM pg_notify('mcp_tasks', json_build_object(
                'v', 1, 'k', 'created', 'tenant_id', t.tenant_id, 'task_id', t.task_id)::text);
        ELSE
            events := events || ROW('complete', 'failed', t.subject, t.client_id, t.issuer, t.task_id, NULL, NULL,
                                    jsonb_build_object('kind', 'failure',
                                                       'reason', items[i].failure ->> 'reason'))::audit_event_item;
        END IF;
        PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', t.tenant_id,
                                                         'task_id', t.task_id, 'session_id', t.session_id)::text);
    END LOOP;
    IF cardinality(events) > 0 THEN
        PERFORM audit_append_events(event_tenants, events);
    END IF;
    FOR i IN 1 .. n LOOP
        RETURN NEXT moved[i];
    END LOOP;
END
$$;

REVOKE ALL ON FUNCTION task_create(jsonb), task_get(text[], text[], text[]), task_retrieve(jsonb), task_finish(jsonb),
    task_hand_back(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION task_create(jsonb), task_get(text[], text[], text[]), task_retrieve(jsonb) TO mcp_tasks_app;
GRANT USAGE ON TYPE task_create_item, task_retrieve_item TO mcp_tasks_app;
GRANT EXECUTE ON FUNCTION task_finish(jsonb), task_hand_back(jsonb) TO mcp_tasks_runner;
GRANT USAGE ON TYPE task_finish_item, task_hand_back_item TO mcp_tasks_runner;
-- Outcomes are the record: finish and hand back run as mcp_tasks_record, the only role that may
-- write a task's outcome columns; the lease check in their bodies decides which rows they change.
-- Their statements find the items' rows in tasks: planned on a young table (and cached for the
-- connection), a hash join or a scan read every task for every batch after. Without hash and merge
-- joins and sequential scans each item's row is found by key however the table has grown.
ALTER FUNCTION task_finish(jsonb) OWNER TO mcp_tasks_record;
ALTER FUNCTION task_finish(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public
    SET enable_hashjoin = off SET enable_mergejoin = off SET enable_seqscan = off;
ALTER FUNCTION task_hand_back(jsonb) OWNER TO mcp_tasks_record;
ALTER FUNCTION task_hand_back(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;


-- ===================================================== hot paths: retention after the end ==
-- A task's lifetime follows its work (docs/decisions.md, D-12): a task a runner has started has
-- no expiry while it works ('infinity': nothing running is deleted for its age, the runtime limit
-- bounds it); one that ends, waits for input or waits for a runner (created or re-queued without
-- one) is kept its TTL from then (ttl_ms is the retention granted). task_create_v2,
-- task_finish_v2 and task_hand_back_v2 set expires_at so, and a claim sets 'infinity';
-- task_create, task_finish and task_hand_back above stay while release 0.1.0 may run beside this
-- one (CONTRIBUTING.md, "Change a SQL function"), and a later release drops them.
CREATE FUNCTION task_create_v2(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_create_item[];
    it task_create_item;
    found_tasks tasks[];
    lock_tenant text;
    mine bigint;
    total bigint;
    counted_tenant text;
    counted_subject text;
    n integer;
    -- The current tenant's creates that passed the caps, not inserted yet, and their places.
    pending task_create_item[] := '{}';
    pending_at integer[] := '{}';
    pending_ids text[] := '{}';
    pending_tenant text;
    t tasks;
    inserted tasks[];
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_create_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    -- The create locks of every tenant of the batch, in tenant order, held until commit.
    FOR lock_tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || lock_tenant, 0));
    END LOOP;
    -- The rows, in the caller's (tenant, subject, task) order. A tenant's creates go in as one
    -- INSERT when the next tenant's first create comes (or the items end: the extra pass), so the
    -- counter trigger (a statement trigger) changes each requestor's counter once, not once per
    -- task. Row-level security checks every row against the tenant set for the INSERT: its own.
    FOR i IN 1 .. n + 1 LOOP
        IF cardinality(pending) > 0 AND (i > n OR items[i].tenant_id IS DISTINCT FROM pending_tenant) THEN
            PERFORM set_config('app.tenant_id', pending_tenant, true);
            IF cardinality(pending) = 1 THEN  -- one create of this tenant: a plain INSERT costs less
                it := pending[1];
                INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool,
                                   arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                   expires_at, lease_owner, lease_expires_at, attempts, started_at,
                                   rerunnable, tool_version)
                VALUES (it.tenant_id, it.task_id, it.subject, it.issuer, it.client_id, it.session_id, it.wire,
                        it.tool, it.arguments, it.client_capabilities, it.progress_token, it.ttl_ms,
                        it.poll_interval_ms,
                        CASE WHEN it.lease_owner IS NULL THEN clock_timestamp() + it.ttl_ms * interval '1 millisecond'
                             ELSE 'infinity'::timestamptz END,
                        it.lease_owner, clock_timestamp() + it.lease_ms * interval '1 millisecond',
                        CASE WHEN it.lease_owner IS NULL THEN 0 ELSE 1 END,
                        CASE WHEN it.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                        it.rerunnable, it.tool_version)
                RETURNING * INTO t;
                found_tasks[pending_at[1]] := t;
            ELSE
            WITH ins AS (
                INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool,
                                   arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                   expires_at, lease_owner, lease_expires_at, attempts, started_at,
                                   rerunnable, tool_version)
                SELECT p.tenant_id, p.task_id, p.subject, p.issuer, p.client_id, p.session_id, p.wire,
                       p.tool, p.arguments, p.client_capabilities, p.progress_token, p.ttl_ms,
                       p.poll_interval_ms,
                       CASE WHEN p.lease_owner IS NULL THEN clock_timestamp() + p.ttl_ms * interval '1 millisecond'
                            ELSE 'infinity'::timestamptz END,
                       p.lease_owner, clock_timestamp() + p.lease_ms * interval '1 millisecond',
                       CASE WHEN p.lease_owner IS NULL THEN 0 ELSE 1 END,
                       CASE WHEN p.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                       p.rerunnable, p.tool_version
                FROM unnest(pending) p
                RETURNING *
            )
            SELECT array_agg(ROW(ins.*)::tasks ORDER BY w.o) INTO inserted
            FROM ins JOIN unnest(pending_ids) WITH ORDINALITY AS w(task_id, o) ON w.task_id = ins.task_id;
            FOR j IN 1 .. cardinality(pending_at) LOOP
                found_tasks[pending_at[j]] := inserted[j];
            END LOOP;
            END IF;
            pending := '{}';
            pending_at := '{}';
            pending_ids := '{}';
        END IF;
        EXIT WHEN i > n;
        it := items[i];
        PERFORM set_config('app.tenant_id', it.tenant_id, true);
        -- The counters are read once per run of one requestor's creates (the batch is sorted), plus
        -- this tenant's creates not inserted yet, and counted on here: the tenant's create lock
        -- keeps other creates out, a finish committed meanwhile only lowers them.
        IF counted_tenant IS DISTINCT FROM it.tenant_id OR counted_subject IS DISTINCT FROM it.subject THEN
            SELECT coalesce(sum(active) FILTER (WHERE subject = it.subject), 0), coalesce(sum(active), 0)
                INTO mine, total
            FROM active_tasks WHERE tenant_id = it.tenant_id AND active > 0;
            total := total + cardinality(pending);
            mine := mine + (SELECT count(*) FROM unnest(pending) p WHERE p.subject = it.subject);
            counted_tenant := it.tenant_id;
            counted_subject := it.subject;
        END IF;
        IF mine < it.max_per_requestor AND total < it.max_per_tenant THEN
            pending_tenant := it.tenant_id;
            pending[cardinality(pending) + 1] := it;
            pending_at[cardinality(pending_at) + 1] := i;
            pending_ids[cardinality(pending_ids) + 1] := it.task_id;
            mine := mine + 1;  -- as the counter trigger will
            total := total + 1;
        END IF;
    END LOOP;
    -- Then the audit events, appended per tenant in tenant order (audit heads after counters, as
    -- every writer), under that tenant; the unleased tasks announced.
    FOR lock_tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
        PERFORM set_config('app.tenant_id', lock_tenant, true);
        PERFORM audit_append_events(array_agg(lock_tenant), array_agg(
                    ROW('create', 'working', x.subject, x.client_id, x.issuer, x.task_id, x.request_id,
                        x.client_address, x.detail)::audit_event_item ORDER BY x.ordinality))
        FROM unnest(items) WITH ORDINALITY AS x
        WHERE x.tenant_id = lock_tenant AND (found_tasks[x.ordinality]).task_id IS NOT NULL
        HAVING count(*) > 0;
    END LOOP;
    FOR i IN 1 .. n LOOP
        IF (found_tasks[i]).task_id IS NOT NULL AND items[i].lease_owner IS NULL THEN
            PERFORM pg_notify('mcp_tasks', json_build_object(
                'v', 1, 'k', 'created', 'tenant_id', items[i].tenant_id, 'task_id', items[i].task_id)::text);
        END IF;
        RETURN NEXT found_tasks[i];
    END LOOP;
END
$$;

CREATE FUNCTION task_finish_v2(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_finish_item[];
    done_tasks tasks[] := '{}';
    done tasks;
    done_list tasks[];
    done_at bigint[];
    n integer;
    events audit_event_item[] := '{}';
    event_tenants text[] := '{}';
    n_events integer := 0;
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_finish_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    -- Every row first, in the caller's (tenant, subject, task) order, before any counter: a
    -- cancel locks its row before that requestor's counter. One statement for them all: each
    -- item's row by primary key, locked in the items' order (a lateral lookup per item, in the
    -- order unnest gives them; a join could be planned, and cached, as a scan of the table).
    PERFORM 1 FROM unnest(items) WITH ORDINALITY AS u
    CROSS JOIN LATERAL (SELECT 1 FROM tasks k WHERE k.tenant_id = u.tenant_id AND k.task_id = u.task_id
                        FOR NO KEY UPDATE) l;
    -- Then one UPDATE for them all, each row under its own lease check, so the counter trigger
    -- changes each requestor's counter once for the batch. The rows are locked already: the join
    -- order does not matter. A task named twice is finished once (the first the join meets).
    WITH finished AS (
        UPDATE tasks t
        SET status = u.status, outcome = u.outcome, payload = u.payload, status_message = u.status_message,
            last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
            expires_at = clock_timestamp() + t.ttl_ms * interval '1 millisecond',
            lease_owner = NULL, lease_expires_at = NULL
        FROM unnest(items) WITH ORDINALITY AS u
        WHERE t.tenant_id = u.tenant_id AND t.task_id = u.task_id AND t.lease_owner = u.owner
          AND t.lease_epoch = u.epoch AND task_status_active(t.status)
        RETURNING t AS done_row, u.ordinality AS pos
    )
    SELECT array_agg(f.done_row ORDER BY f.pos), array_agg(f.pos ORDER BY f.pos) INTO done_list, done_at FROM finished f;
    FOR j IN 1 .. coalesce(cardinality(done_at), 0) LOOP
        done_tasks[done_at[j]] := done_list[j];
    END LOOP;
    -- The audit events in item order, appended by one call for all their tenants.
    FOR i IN 1 .. n LOOP
        done := done_tasks[i];
        CONTINUE WHEN done.task_id IS NULL;
        n_events := n_events + 1;
        event_tenants[n_events] := done.tenant_id;
        events[n_events] := ROW('complete', done.status::text, done.subject, done.client_id, done.issuer,
                                done.task_id, NULL, NULL, items[i].detail)::audit_event_item;
        PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', done.tenant_id,
                                                         'task_id', done.task_id, 'session_id', done.session_id)::text);
    END LOOP;
    IF n_events > 0 THEN
        PERFORM audit_append_events(event_tenants, events);
    END IF;
    FOR i IN 1 .. n LOOP
        RETURN NEXT done_tasks[i];
    END LOOP;
END
$$;

CREATE FUNCTION task_hand_back_v2(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_hand_back_item[];
    it task_hand_back_item;
    moved tasks[];
    requeued boolean[];
    t tasks;
    n integer;
    events audit_event_item[] := '{}';
    event_tenants text[] := '{}';
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_hand_back_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    PERFORM 1 FROM unnest(items) WITH ORDINALITY AS u
    CROSS JOIN LATERAL (SELECT 1 FROM tasks k WHERE k.tenant_id = u.tenant_id AND k.task_id = u.task_id
                        FOR NO KEY UPDATE) l;
    FOR i IN 1 .. n LOOP
        it := items[i];
        t := NULL;
        requeued[i] := false;
        UPDATE tasks
        SET status = 'working', status_message = format('%s (attempt %s)', it.requeue_message, attempts + 1),
            last_updated_at = clock_timestamp(), expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond',
            lease_owner = NULL,
            lease_expires_at = NULL, lease_epoch = lease_epoch + 1
        WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
          AND lease_epoch = it.epoch
          AND (it.only_if_lapsed IS NOT TRUE OR lease_lapsed(lease_owner, lease_expires_at))
          AND task_status_active(status) AND it.rerunnable AND attempts < it.max_attempts
        RETURNING * INTO t;
        IF t.task_id IS NOT NULL THEN
            requeued[i] := true;
            -- Its questions were asked by the run that stopped: they can no longer be answered.
            DELETE FROM task_messages WHERE tenant_id = it.tenant_id AND task_id = it.task_id
                AND answered_at IS NULL;
        ELSE
            UPDATE tasks
            SET status = 'failed', outcome = 'failure', payload = it.failure,
                status_message = it.failure ->> 'message',
                last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
                expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond',
                lease_owner = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
              AND lease_epoch = it.epoch
              AND (it.only_if_lapsed IS NOT TRUE OR lease_lapsed(lease_owner, lease_expires_at))
              AND task_status_active(status)
            RETURNING * INTO t;
        END IF;
        moved[i] := t;
    END LOOP;
    FOR i IN 1 .. n LOOP
        t := moved[i];
        CONTINUE WHEN t.task_id IS NULL;
        event_tenants := event_tenants || t.tenant_id;
        IF requeued[i] THEN
            events := events || ROW('requeue', 'working', t.subject, t.client_id, t.issuer, t.task_id, NULL, NULL,
                                    jsonb_build_object('attempt', t.attempts + 1, 'owner', items[i].owner))::audit_event_item;
            PERFORM pg_notify('mcp_tasks', json_build_object(
                'v', 1, 'k', 'created', 'tenant_id', t.tenant_id, 'task_id', t.task_id)::text);
        ELSE
            events := events || ROW('complete', 'failed', t.subject, t.client_id, t.issuer, t.task_id, NULL, NULL,
                                    jsonb_build_object('kind', 'failure',
                                                       'reason', items[i].failure ->> 'reason'))::audit_event_item;
        END IF;
        PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', t.tenant_id,
                                                         'task_id', t.task_id, 'session_id', t.session_id)::text);
    END LOOP;
    IF cardinality(events) > 0 THEN
        PERFORM audit_append_events(event_tenants, events);
    END IF;
    FOR i IN 1 .. n LOOP
        RETURN NEXT moved[i];
    END LOOP;
END
$$;

-- Release 0.1.0's statements end or pause a task without setting its expiry: while it runs beside
-- this release, a task of this release that one of them ends, cancels or makes wait for input
-- gets its retention from that change here, so that no row is kept forever. This release's own
-- statements set a finite expiry with any such change, and the trigger's condition skips them.
CREATE FUNCTION tasks_retention_from_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.expires_at := clock_timestamp() + NEW.ttl_ms * interval '1 millisecond';
    RETURN NEW;
END
$$;
CREATE TRIGGER tasks_retention_from_change BEFORE UPDATE OF status ON tasks
    FOR EACH ROW WHEN (NEW.status <> 'working' AND NEW.expires_at = 'infinity')
    EXECUTE FUNCTION tasks_retention_from_change();

REVOKE ALL ON FUNCTION task_create_v2(jsonb), task_finish_v2(jsonb), task_hand_back_v2(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION task_create_v2(jsonb) TO mcp_tasks_app;
GRANT EXECUTE ON FUNCTION task_finish_v2(jsonb), task_hand_back_v2(jsonb) TO mcp_tasks_runner;
ALTER FUNCTION task_finish_v2(jsonb) OWNER TO mcp_tasks_record;
ALTER FUNCTION task_finish_v2(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public
    SET enable_hashjoin = off SET enable_mergejoin = off SET enable_seqscan = off;
ALTER FUNCTION task_hand_back_v2(jsonb) OWNER TO mcp_tasks_record;
ALTER FUNCTION task_hand_back_v2(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;


-- =============================================================================== maintenance ==
-- The planner's statistics, when the server's autovacuum (which keeps them) is off: the
-- maintenance pass calls this then, and it analyses each of the service's tables whose rows
-- changed since its last analysis by more than autovacuum's default threshold (50 rows and 10 %),
-- at most once per p_every per table (a minute: autovacuum's naptime).
-- Without statistics a lookup of one task by (tenant_id, task_id) may walk every task of the
-- tenant in tasks_owner_recent. Owned by the schema's owner
-- (ANALYZE needs the table's owner); it does nothing else.
CREATE FUNCTION analyze_stale_tables(p_every interval) RETURNS text[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    stale text;
    analysed text[] := '{}';
BEGIN
    -- One process at a time; another that finds it taken has nothing to add. Every call qualified
    -- and typed exactly, so nothing created in public can stand in for it.
    IF NOT pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtextextended('mcp_tasks:analyze'::text, 0::bigint)) THEN
        RETURN analysed;
    END IF;
    FOR stale IN
        SELECT s.relname::text
        FROM pg_catalog.pg_stat_user_tables s JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) s.relid
        WHERE s.relid OPERATOR(pg_catalog.=) ANY (ARRAY[
                  'tasks'::regclass::oid, 'active_tasks'::regclass::oid, 'task_messages'::regclass::oid,
                  'sessions'::regclass::oid, 'event_payloads'::regclass::oid, 'runners'::regclass::oid,
                  'audit_events'::regclass::oid, 'audit_heads'::regclass::oid, 'audit_retrievals'::regclass::oid])
          -- (OPERATOR() binds as any other operator does: left to right, hence the parentheses.)
          AND s.n_mod_since_analyze::double precision OPERATOR(pg_catalog.>)
              (50::double precision OPERATOR(pg_catalog.+)
               (0.1::double precision OPERATOR(pg_catalog.*) greatest(c.reltuples, 0::real)::double precision))
          -- At most once per p_every per table (the service: a minute, autovacuum's naptime).
          AND coalesce(greatest(s.last_analyze, s.last_autoanalyze), '-infinity'::timestamptz)
              OPERATOR(pg_catalog.<) (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) p_every)
        ORDER BY 1
    LOOP
        EXECUTE pg_catalog.format('ANALYZE %I'::text, stale);
        analysed := pg_catalog.array_append(analysed, stale);
    END LOOP;
    RETURN analysed;
END
$$;
REVOKE ALL ON FUNCTION analyze_stale_tables(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION analyze_stale_tables(interval) TO mcp_tasks_runner;

-- The first statistics of a new deployment's tables, whatever autovacuum does: each
-- of the service's tables never analysed in which more than 50 rows changed is analysed, one
-- process at a time; one row per table never analysed when called, with whether this call analysed
-- it and how many of its rows changed. The maintenance pass calls it every fraction of a second
-- while tasks fills unanalysed (the plans cached before its statistics walk tasks_owner_recent, see
-- above). Owned by the schema's owner.
CREATE FUNCTION analyze_young_tables() RETURNS TABLE (relname text, analysed boolean, changed bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
#variable_conflict use_column
DECLARE
    -- Every call qualified and typed exactly, so nothing created in public can stand in for it.
    locked boolean := pg_catalog.pg_try_advisory_xact_lock(
        pg_catalog.hashtextextended('mcp_tasks:analyze'::text, 0::bigint));
    young record;
BEGIN
    FOR young IN
        SELECT c.relname::text AS name, s.n_mod_since_analyze AS n_mod
        FROM pg_catalog.pg_class c JOIN pg_catalog.pg_stat_user_tables s ON s.relid OPERATOR(pg_catalog.=) c.oid
        WHERE c.oid OPERATOR(pg_catalog.=) ANY (ARRAY[
                  'tasks'::regclass::oid, 'active_tasks'::regclass::oid, 'task_messages'::regclass::oid,
                  'sessions'::regclass::oid, 'event_payloads'::regclass::oid, 'runners'::regclass::oid,
                  'audit_events'::regclass::oid, 'audit_heads'::regclass::oid, 'audit_retrievals'::regclass::oid])
          -- Never analysed, as far as the server's counters know (pg_stats would not say: row-level
          -- security hides the tables' statistics from an owner that is not a superuser). Counters
          -- lost in a crash make a table young again: it is analysed once more at 50 changes.
          AND s.last_analyze IS NULL AND s.last_autoanalyze IS NULL
        ORDER BY 1
    LOOP
        relname := young.name;
        changed := young.n_mod;
        -- Autovacuum's base threshold (more than 50 rows changed). Another process that holds the
        -- lock is analysing; this call reports the table as young and not analysed.
        analysed := young.n_mod OPERATOR(pg_catalog.>) 50::bigint AND locked;
        IF analysed THEN
            EXECUTE pg_catalog.format('ANALYZE %I'::text, young.name);
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
REVOKE ALL ON FUNCTION analyze_young_tables() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION analyze_young_tables() TO mcp_tasks_runner;


-- ===================================================================================== usage ==
-- Plain calls (answered inside their request, never a task) per tenant, tool and hour (UTC), for
-- `mcp-tasks usage`: they are not in the audit record (a row each would cost a plain call more
-- than its answer). Each process counts them in memory and its maintenance pass adds its counts
-- here (and at shutdown): a crash loses at most one pass's counts. Only the runner role, which
-- reports across tenants, reads or writes them.
CREATE TABLE usage_plain_calls (
    tenant_id text        NOT NULL,
    tool      text        NOT NULL,
    hour      timestamptz NOT NULL,
    calls     bigint      NOT NULL,
    CONSTRAINT usage_plain_calls_pkey PRIMARY KEY (tenant_id, tool, hour),
    CONSTRAINT usage_plain_calls_counted CHECK (calls > 0),
    CONSTRAINT usage_plain_calls_on_the_hour CHECK (hour = date_trunc('hour', hour, 'UTC'))
);

GRANT SELECT, INSERT, UPDATE ON usage_plain_calls TO mcp_tasks_runner;
ALTER TABLE usage_plain_calls ENABLE ROW LEVEL SECURITY;
ALTER TABLE usage_plain_calls FORCE ROW LEVEL SECURITY;
CREATE POLICY usage_plain_calls_runner_only ON usage_plain_calls TO mcp_tasks_runner
    USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');

-- ================================================================================= upstreams ==
-- Each process follows its upstreams itself (MCP_TASKS_UPSTREAMS_FILE) and says here what it sees:
-- {transport, state, down_since, circuit, tools, last_error}, on every change and every few
-- seconds, its word holding until live_until; a process that stops takes its rows back, and rows
-- long past their word are deleted by the next write. `mcp-tasks upstreams` reads the live ones.
-- Nothing here is a tenant's: only the runner role (and the record role, to read) may see it.
CREATE TABLE upstream_states (
    owner      text        NOT NULL,
    upstream   text        NOT NULL,
    state      jsonb       NOT NULL,
    seen_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    live_until timestamptz NOT NULL,
    CONSTRAINT upstream_states_pkey PRIMARY KEY (owner, upstream),
    CONSTRAINT upstream_states_state_object CHECK (jsonb_typeof(state) = 'object')
);

GRANT SELECT, INSERT, UPDATE, DELETE ON upstream_states TO mcp_tasks_runner;
ALTER TABLE upstream_states ENABLE ROW LEVEL SECURITY;
ALTER TABLE upstream_states FORCE ROW LEVEL SECURITY;
CREATE POLICY upstream_states_runner_only ON upstream_states TO mcp_tasks_runner
    USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');
GRANT SELECT ON upstream_states TO mcp_tasks_record;
CREATE POLICY upstream_states_record_reads ON upstream_states FOR SELECT TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record');

-- ============================================================================== task notes ==
-- A run's note to the run that may follow it after a takeover (a tool's ToolContext.remember):
-- one small JSON object per task, written by the runner holding the task's lease (the write names
-- owner and epoch), read when a run starts. An upstream MCP server's task id lives here, so that
-- the next runner follows the same upstream task instead of calling again. A task with a note is
-- handed back to the queue, not failed: its tool decides from the note (docs/decisions.md,
-- "Upstream MCP servers"). Deleted with its task.
CREATE TABLE task_notes (
    tenant_id  text        NOT NULL,
    task_id    text        NOT NULL,
    note       jsonb       NOT NULL,
    written_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT task_notes_pkey PRIMARY KEY (tenant_id, task_id),
    CONSTRAINT task_notes_task_fkey FOREIGN KEY (tenant_id, task_id)
        REFERENCES tasks (tenant_id, task_id) ON DELETE CASCADE,
    CONSTRAINT task_notes_object CHECK (jsonb_typeof(note) = 'object'),
    CONSTRAINT task_notes_small CHECK (octet_length(note::text) <= 16384)
);

GRANT SELECT, INSERT, UPDATE, DELETE ON task_notes TO mcp_tasks_runner;
GRANT SELECT, DELETE ON task_notes TO mcp_tasks_app, mcp_tasks_record;
ALTER TABLE task_notes ENABLE ROW LEVEL SECURITY;
ALTER TABLE task_notes FORCE ROW LEVEL SECURITY;
CREATE POLICY task_notes_tenant_isolation ON task_notes TO mcp_tasks_app
    USING (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY task_notes_runner_all_tenants ON task_notes TO mcp_tasks_runner
    USING (current_user = 'mcp_tasks_runner') WITH CHECK (current_user = 'mcp_tasks_runner');
CREATE POLICY task_notes_record ON task_notes TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record');

-- ======================================================== the tenant's storage quota ==
-- What a tenant makes the service keep (issue 42, point 6): each task row's stored_bytes is the
-- size of what the client chose (arguments, capabilities, progress token) and of its result, set by
-- task_create_v3 and by the trigger below whenever a result is written (by any release's
-- statement); the counters' triggers sum it per requestor beside the active count, so the quota is
-- read from the same rows as the caps. Rows of tasks created before this revision count 0 until
-- they are deleted (they were never counted). Status messages (at most 500 characters), questions
-- and answers and upstream notes (at most 16 KiB) are bounded per task, not counted.
CREATE FUNCTION tasks_size_payload() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.stored_bytes := greatest(OLD.stored_bytes + coalesce(pg_column_size(NEW.payload), 0)
                                 - coalesce(pg_column_size(OLD.payload), 0), 0);
    RETURN NEW;
END
$$;
CREATE TRIGGER tasks_size_payload BEFORE UPDATE OF payload ON tasks
    FOR EACH ROW WHEN (OLD.payload IS DISTINCT FROM NEW.payload)
    EXECUTE FUNCTION tasks_size_payload();

-- The counters' triggers with the bytes beside the active count (the same rows, the same order).
-- Creates checked against the tenant's storage quota too (max_tenant_bytes; NULL: none), with
-- each row's stored_bytes set. task_create_v2 stays while the previous release may run beside
-- this one.
CREATE FUNCTION task_create_v3(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_create_item[];
    it task_create_item;
    found_tasks tasks[];
    lock_tenant text;
    held bigint;
    size bigint;
    pending_bytes bigint := 0;
    mine bigint;
    total bigint;
    counted_tenant text;
    counted_subject text;
    n integer;
    -- The current tenant's creates that passed the caps, not inserted yet, and their places.
    pending task_create_item[] := '{}';
    pending_at integer[] := '{}';
    pending_ids text[] := '{}';
    pending_tenant text;
    t tasks;
    inserted tasks[];
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_create_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    -- The create locks of every tenant of the batch, in tenant order, held until commit.
    FOR lock_tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || lock_tenant, 0));
    END LOOP;
    -- The rows, in the caller's (tenant, subject, task) order. A tenant's creates go in as one
    -- INSERT when the next tenant's first create comes (or the items end: the extra pass), so the
    -- counter trigger (a statement trigger) changes each requestor's counter once, not once per
    -- task. Row-level security checks every row against the tenant set for the INSERT: its own.
    FOR i IN 1 .. n + 1 LOOP
        IF cardinality(pending) > 0 AND (i > n OR items[i].tenant_id IS DISTINCT FROM pending_tenant) THEN
            PERFORM set_config('app.tenant_id', pending_tenant, true);
            IF cardinality(pending) = 1 THEN  -- one create of this tenant: a plain INSERT costs less
                it := pending[1];
                INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool,
                                   arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                   expires_at, lease_owner, lease_expires_at, attempts, started_at,
                                   rerunnable, tool_version, stored_bytes, trace_parent)
                VALUES (it.tenant_id, it.task_id, it.subject, it.issuer, it.client_id, it.session_id, it.wire,
                        it.tool, it.arguments, it.client_capabilities, it.progress_token, it.ttl_ms,
                        it.poll_interval_ms,
                        CASE WHEN it.lease_owner IS NULL THEN clock_timestamp() + it.ttl_ms * interval '1 millisecond'
                             ELSE 'infinity'::timestamptz END,
                        it.lease_owner, clock_timestamp() + it.lease_ms * interval '1 millisecond',
                        CASE WHEN it.lease_owner IS NULL THEN 0 ELSE 1 END,
                        CASE WHEN it.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                        it.rerunnable, it.tool_version,
                        pg_column_size(it.arguments) + coalesce(pg_column_size(it.client_capabilities), 0)
                        + coalesce(pg_column_size(it.progress_token), 0), it.trace_parent)
                RETURNING * INTO t;
                found_tasks[pending_at[1]] := t;
            ELSE
            WITH ins AS (
                INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool,
                                   arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                   expires_at, lease_owner, lease_expires_at, attempts, started_at,
                                   rerunnable, tool_version, stored_bytes, trace_parent)
                SELECT p.tenant_id, p.task_id, p.subject, p.issuer, p.client_id, p.session_id, p.wire,
                       p.tool, p.arguments, p.client_capabilities, p.progress_token, p.ttl_ms,
                       p.poll_interval_ms,
                       CASE WHEN p.lease_owner IS NULL THEN clock_timestamp() + p.ttl_ms * interval '1 millisecond'
                            ELSE 'infinity'::timestamptz END,
                       p.lease_owner, clock_timestamp() + p.lease_ms * interval '1 millisecond',
                       CASE WHEN p.lease_owner IS NULL THEN 0 ELSE 1 END,
                       CASE WHEN p.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                       p.rerunnable, p.tool_version,
                       pg_column_size(p.arguments) + coalesce(pg_column_size(p.client_capabilities), 0)
                       + coalesce(pg_column_size(p.progress_token), 0), p.trace_parent
                FROM unnest(pending) p
                RETURNING *
            )
            SELECT array_agg(ROW(ins.*)::tasks ORDER BY w.o) INTO inserted
            FROM ins JOIN unnest(pending_ids) WITH ORDINALITY AS w(task_id, o) ON w.task_id = ins.task_id;
            FOR j IN 1 .. cardinality(pending_at) LOOP
                found_tasks[pending_at[j]] := inserted[j];
            END LOOP;
            END IF;
            pending := '{}';
            pending_at := '{}';
            pending_ids := '{}';
            pending_bytes := 0;
        END IF;
        EXIT WHEN i > n;
        it := items[i];
        PERFORM set_config('app.tenant_id', it.tenant_id, true);
        -- The counters are read once per run of one requestor's creates (the batch is sorted), plus
        -- this tenant's creates not inserted yet, and counted on here: the tenant's create lock
        -- keeps other creates out, a finish committed meanwhile only lowers the active counts (and
        -- adds its result's bytes: the quota admits creates, a result is never refused).
        IF counted_tenant IS DISTINCT FROM it.tenant_id OR counted_subject IS DISTINCT FROM it.subject THEN
            SELECT coalesce(sum(active) FILTER (WHERE subject = it.subject AND active > 0), 0),
                   coalesce(sum(active) FILTER (WHERE active > 0), 0), greatest(coalesce(sum(bytes), 0), 0)
                INTO mine, total, held
            FROM active_tasks WHERE tenant_id = it.tenant_id;
            total := total + cardinality(pending);
            held := held + pending_bytes;
            mine := mine + (SELECT count(*) FROM unnest(pending) p WHERE p.subject = it.subject);
            counted_tenant := it.tenant_id;
            counted_subject := it.subject;
        END IF;
        -- The bytes the row will hold (stored_bytes): what the tenant's storage quota counts.
        size := pg_column_size(it.arguments) + coalesce(pg_column_size(it.client_capabilities), 0)
                + coalesce(pg_column_size(it.progress_token), 0);
        IF mine < it.max_per_requestor AND total < it.max_per_tenant
           AND (it.max_tenant_bytes IS NULL OR held + size <= it.max_tenant_bytes) THEN
            pending_tenant := it.tenant_id;
            pending[cardinality(pending) + 1] := it;
            pending_at[cardinality(pending_at) + 1] := i;
            pending_ids[cardinality(pending_ids) + 1] := it.task_id;
            mine := mine + 1;  -- as the counter trigger will
            total := total + 1;
            held := held + size;
            pending_bytes := pending_bytes + size;
        END IF;
    END LOOP;
    -- Then the audit events, appended per tenant in tenant order (audit heads after counters, as
    -- every writer), under that tenant; the unleased tasks announced.
    FOR lock_tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
        PERFORM set_config('app.tenant_id', lock_tenant, true);
        PERFORM audit_append_events(array_agg(lock_tenant), array_agg(
                    ROW('create', 'working', x.subject, x.client_id, x.issuer, x.task_id, x.request_id,
                        x.client_address, x.detail)::audit_event_item ORDER BY x.ordinality))
        FROM unnest(items) WITH ORDINALITY AS x
        WHERE x.tenant_id = lock_tenant AND (found_tasks[x.ordinality]).task_id IS NOT NULL
        HAVING count(*) > 0;
    END LOOP;
    FOR i IN 1 .. n LOOP
        IF (found_tasks[i]).task_id IS NOT NULL AND items[i].lease_owner IS NULL THEN
            PERFORM pg_notify('mcp_tasks', json_build_object(
                'v', 1, 'k', 'created', 'tenant_id', items[i].tenant_id, 'task_id', items[i].task_id)::text);
        END IF;
        RETURN NEXT found_tasks[i];
    END LOOP;
END
$$;

REVOKE ALL ON FUNCTION task_create_v3(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION task_create_v3(jsonb) TO mcp_tasks_app;

-- ======================================================= a task's trace context, read back ==
-- Gets and retrieves with the task's trace_parent (issue 44): a later request about a task links to
-- the trace of the request that created it. task_get and task_retrieve above stay while the
-- previous release may run beside this one.
CREATE FUNCTION task_get_v2(p_tenants text[], p_task_ids text[], p_subjects text[])
RETURNS TABLE (o integer, tenant_id text, task_id text, subject text, issuer text, client_id text,
               session_id text, wire text, tool text, progress_token jsonb, status task_status,
               status_message text, outcome text, payload jsonb, ttl_ms bigint, poll_interval_ms integer,
               created_at timestamptz, last_updated_at timestamptz, attempts integer, expires_at timestamptz,
               trace_parent text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    tenant text;
BEGIN
    -- Each item's row by primary key alone (a subquery kept whole by OFFSET 0: with the subject
    -- among its conditions the planner may walk tasks_owner_recent, every task of the subject),
    -- then kept when it is the item's subject's and unexpired, with the item's place.
    FOR tenant IN SELECT DISTINCT u FROM unnest(p_tenants) AS u LOOP
        PERFORM set_config('app.tenant_id', tenant, true);
        RETURN QUERY
        SELECT w.o::integer, t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.wire,
               t.tool, t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
               t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at, t.trace_parent
        FROM unnest(p_tenants, p_task_ids, p_subjects) WITH ORDINALITY AS w(tenant_id, task_id, subject, o)
        CROSS JOIN LATERAL (
            SELECT k.tenant_id, k.task_id, k.subject, k.issuer, k.client_id, k.session_id, k.wire, k.tool,
                   k.progress_token, k.status, k.status_message, k.outcome, k.payload, k.ttl_ms,
                   k.poll_interval_ms, k.created_at, k.last_updated_at, k.attempts, k.expires_at, k.trace_parent
            FROM tasks k
            WHERE k.tenant_id = w.tenant_id AND k.task_id = w.task_id
            OFFSET 0
        ) t
        WHERE w.tenant_id = tenant AND t.subject = w.subject AND t.expires_at > clock_timestamp();
    END LOOP;
END
$$;

CREATE FUNCTION task_retrieve_v2(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_retrieve_item[];
    it task_retrieve_item;
    found_tasks tasks[];
    t tasks;
    tenant text;
    n integer;
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_retrieve_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    FOR i IN 1 .. n LOOP
        it := items[i];
        t := NULL;
        PERFORM set_config('app.tenant_id', it.tenant_id, true);
        -- Only what a lookup answers with (not the arguments nor the client's capabilities), by
        -- primary key alone, then the owner and the expiry checked here (as task_get).
        SELECT tenant_id, task_id, subject, issuer, client_id, session_id, wire, tool, progress_token,
               status, status_message, outcome, payload, ttl_ms, poll_interval_ms, created_at,
               last_updated_at, attempts, expires_at, trace_parent
        INTO t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.wire, t.tool,
             t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
             t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at, t.trace_parent
        FROM tasks
        WHERE tenant_id = it.tenant_id AND task_id = it.task_id;
        IF t.task_id IS NOT NULL AND (t.subject <> it.subject OR NOT t.expires_at > clock_timestamp()) THEN
            t := NULL;
        END IF;
        found_tasks[i] := t;
    END LOOP;
    -- The hand-outs of finished tasks, appended per tenant in tenant order, under that tenant.
    FOR tenant IN SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u ORDER BY 1 LOOP
        PERFORM set_config('app.tenant_id', tenant, true);
        PERFORM audit_append_events(array_agg(tenant), array_agg(
                    ROW('retrieve', (found_tasks[x.ordinality]).status::text, x.subject, x.client_id, x.issuer,
                        x.task_id, x.request_id, x.client_address, NULL)::audit_event_item ORDER BY x.ordinality))
        FROM unnest(items) WITH ORDINALITY AS x
        WHERE x.tenant_id = tenant AND (found_tasks[x.ordinality]).task_id IS NOT NULL
          AND NOT task_status_active((found_tasks[x.ordinality]).status)
        HAVING count(*) > 0;
    END LOOP;
    FOR i IN 1 .. n LOOP
        RETURN NEXT found_tasks[i];
    END LOOP;
END
$$;

REVOKE ALL ON FUNCTION task_get_v2(text[], text[], text[]), task_retrieve_v2(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION task_get_v2(text[], text[], text[]), task_retrieve_v2(jsonb) TO mcp_tasks_app;
