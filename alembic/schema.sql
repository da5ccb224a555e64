-- The current schema of mcp-task-service: the one truth, read top to bottom.
--
-- Migrations (alembic/versions/) are the history and never change once committed; this file is
-- what they add up to. tests/test_schema_truth.py builds one database from the migrations and one
-- from this file alone and compares their `pg_dump --schema-only`: change the schema by editing
-- this file AND adding a migration (CONTRIBUTING.md). Grants on alembic_version are the
-- migrations' business and are not repeated here.
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
-- NULL`, which is that comparison as the planner should see it (migration 0018): a comparison
-- without a column is estimated to hold for 0.5 % of rows, so every scan of the role was planned
-- for 1/200 of its rows (a backlog's claim sorted a scan of the queue on disk instead of reading
-- the queue's index in order); a null test of an expression is estimated to hold for 99.5 %. The
-- record role's keep the comparison: its lookups by key cost more planned the other way.
-- A third NOLOGIN role, mcp_tasks_record, owns the functions that write the record (the audit
-- chain, task outcomes); the login user is never a member of it, so the service's credentials
-- reach the record only through those functions (SECURITY.md: what the credentials can do).
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
END
$$;
GRANT USAGE ON SCHEMA public TO mcp_tasks_app, mcp_tasks_runner, mcp_tasks_record;
-- Nobody but the owner creates in public (migration 0016): an object the service's login created
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
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO mcp_tasks_app, mcp_tasks_runner', current_database());
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
    surface             text        NOT NULL,
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
    lease_key           bigint,
    lease_expires_at    timestamptz,
    attempts            integer     NOT NULL DEFAULT 0,
    -- Whether the tool may run again after a lost run, and the version of the tool the task was
    -- accepted for, both as the accepting process's registry said at create: the reaper decides
    -- from the row, not from its own (perhaps different) tool packs. NULL: created by a release
    -- that did not record them (the deciding process's registry decides, as it did then).
    rerunnable          boolean,
    tool_version        text,
    -- The fencing token is (lease_owner, lease_epoch): the epoch grows whenever the lease changes
    -- hands (a claim, a hand-back), and a runner's finish, release, renewal and questions act only
    -- while both still match what it was given (docs/decisions.md, "Fencing").
    lease_epoch         bigint      NOT NULL DEFAULT 0,
    CONSTRAINT tasks_pkey PRIMARY KEY (tenant_id, task_id),
    CONSTRAINT tasks_surface_known CHECK (surface IN ('2025-11-25', '2026-07-28')),
    CONSTRAINT tasks_ttl_positive CHECK (ttl_ms > 0),
    CONSTRAINT tasks_lease_complete CHECK (
        (lease_owner IS NULL) = (lease_expires_at IS NULL) AND (lease_owner IS NULL) = (lease_key IS NULL)
    ),
    -- One stored outcome, rendered per wire: a tool error is a completed call (its result says
    -- so), and only a call that failed is failed.
    CONSTRAINT tasks_outcome_matches_status CHECK (
           (status = 'completed' AND outcome IN ('result', 'tool_error') AND payload IS NOT NULL)
        OR (status = 'failed' AND outcome = 'failure' AND payload IS NOT NULL)
        OR (status IN ('working', 'input_required', 'cancelled') AND outcome IS NULL AND payload IS NULL)
    ),
    CONSTRAINT tasks_lease_only_while_active CHECK (
        lease_owner IS NULL OR task_status_active(status)
    )
);
-- Runners claim from here: the queue, unclaimed and unfinished rows, oldest first. They are the
-- working ones: a task asks for input only while a runner holds it, and every hand-back makes it
-- working again (task_release_batch). Null tests only, because they call no operator: row-level
-- security applies to the service's roles, and under it the planner may not use a column's
-- statistics with an operator that is not leakproof, as the enum's `=` is not: `status =
-- 'working'` was estimated from the column's count of distinct values alone, so in a table of
-- finished tasks the queue looked like half of it, or all, and a large table was scanned instead
-- (migration 0017).
CREATE INDEX tasks_queued ON tasks (created_at) WHERE lease_owner IS NULL AND finished_at IS NULL;
-- The same rows as the release before named them, kept while it may still run beside this one (its
-- claims read it; CONTRIBUTING.md, "expand, then contract"). A later release drops it.
CREATE INDEX tasks_claimable ON tasks (created_at) WHERE status = 'working' AND lease_owner IS NULL;
-- The reaper scans leases that may have lapsed.
CREATE INDEX tasks_leased ON tasks (lease_expires_at) WHERE lease_owner IS NOT NULL;
-- tasks/list keyset pagination, newest first.
CREATE INDEX tasks_owner_recent ON tasks (tenant_id, subject, created_at DESC, task_id DESC);
-- (No index of active tasks per requestor: the caps read the active_tasks counters, the queue
-- gauges the two partial indexes above; migration 0015.)
-- The sweeper deletes by expiry.
CREATE INDEX tasks_expiry ON tasks (expires_at);
-- The tasks_active gauge counts input_required tasks here (the active total comes from the
-- counters): a count over every active task's row grew with the tasks running.
CREATE INDEX tasks_input_required ON tasks (tenant_id) WHERE status = 'input_required';

GRANT SELECT, INSERT, DELETE ON tasks TO mcp_tasks_app, mcp_tasks_runner;
-- Task outcomes: written only through task_finish_batch and task_release_batch (which check the
-- lease and run as mcp_tasks_record). The service's roles update only the columns their
-- statements set; a task is inserted working, and deleted only once expired.
GRANT UPDATE (status, status_message, last_updated_at, finished_at, lease_owner, lease_key, lease_expires_at)
    ON tasks TO mcp_tasks_app;
GRANT UPDATE (status, status_message, last_updated_at, lease_owner, lease_key, lease_expires_at, attempts,
              started_at, lease_epoch)
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
    INSERT INTO active_tasks (tenant_id, subject, active)
    SELECT tenant_id, subject, count(*) FROM new_rows WHERE task_status_active(status)
    GROUP BY tenant_id, subject ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
    ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + excluded.active;
    RETURN NULL;
END
$$;
-- A trigger with transition tables cannot name columns, so this one fires for every UPDATE (a
-- lease renewal too): the rows whose activity did not change cancel out and nothing is written.
-- Old and new rows are summed apart, so even a requestor that changed would be counted right.
CREATE FUNCTION tasks_count_updated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO active_tasks (tenant_id, subject, active)
    SELECT tenant_id, subject, sum(d) FROM (
        SELECT tenant_id, subject, 1 AS d FROM new_rows WHERE task_status_active(status)
        UNION ALL
        SELECT tenant_id, subject, -1 AS d FROM old_rows WHERE task_status_active(status)
    ) changed
    GROUP BY tenant_id, subject HAVING sum(d) <> 0
    ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
    ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + excluded.active;
    RETURN NULL;
END
$$;
CREATE FUNCTION tasks_count_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO active_tasks (tenant_id, subject, active)
    SELECT tenant_id, subject, -count(*) FROM old_rows WHERE task_status_active(status)
    GROUP BY tenant_id, subject ORDER BY tenant_id COLLATE "C", subject COLLATE "C"
    ON CONFLICT (tenant_id, subject) DO UPDATE SET active = active_tasks.active + excluded.active;
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
-- revived by a beat, see lease_lapsed), and it deletes the row when it stops. "Live" also needs its
-- liveness lock (lease_key) held, so a runner that died is not counted for a moment longer. Not
-- tenant data: only the runner role sees it.
-- tools: {"<name>": {"version": <text or null>, "rerunnable": <bool>}, ...}
CREATE TABLE runners (
    owner       text        NOT NULL,
    lease_key   bigint      NOT NULL,
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
-- lease. Only for owners named so ('+row', service/runtime/fencing.py ROW_LEASE): a runner of an
-- earlier release renews each task's own lease and is judged by that alone. The rule of
-- task_release_batch's re-check under the row lock; find_lost_leases searches with the same rule.
CREATE FUNCTION lease_lapsed(p_owner text, p_expires_at timestamptz) RETURNS boolean
LANGUAGE sql VOLATILE
RETURN p_expires_at < clock_timestamp()
    OR (p_owner LIKE '%+row'
        AND NOT EXISTS (SELECT 1 FROM runners r WHERE r.owner = p_owner AND r.live_until > clock_timestamp()));


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
-- events and heads and call the functions below, which run as mcp_tasks_record: audit_append (one
-- event) and audit_append_many (a batch's events of one tenant) take the time themselves (never
-- earlier than the chain's last event) and compute the hash; so does audit_append_all (a batch's
-- events of many tenants), which only the record's own functions call. A trigger
-- refuses UPDATE and TRUNCATE for everyone, and DELETE to all but audit_purge (retention).
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
        ('create', 'complete', 'retrieve', 'cancel', 'input', 'expire', 'deny', 'requeue', 'purge')),
    CONSTRAINT audit_events_seq_positive CHECK (seq > 0),
    CONSTRAINT audit_events_hash_size CHECK (octet_length(hash) = 32 AND octet_length(prev_hash) = 32)
);
-- An export from a time on (`mcp-tasks audit export --since`): times grow with the chain, so a
-- block range index is enough and costs an insert next to nothing (migration 0015).
CREATE INDEX audit_events_at ON audit_events USING brin (at);

-- Besides the last seq and hash: the time of the last event (no event is dated before it), how
-- far `mcp-tasks audit export` has read the chain from its start (exported_seq), and the last row
-- a purge removed (purged_seq, purged_hash: the checkpoint the first remaining row links to).
CREATE TABLE audit_heads (
    tenant_id    text        NOT NULL,
    seq          bigint      NOT NULL,
    hash         bytea       NOT NULL,
    at           timestamptz,
    exported_seq bigint      NOT NULL DEFAULT 0,
    purged_seq   bigint      NOT NULL DEFAULT 0,
    purged_hash  bytea       NOT NULL DEFAULT decode(repeat('00', 32), 'hex'),
    CONSTRAINT audit_heads_pkey PRIMARY KEY (tenant_id),
    CONSTRAINT audit_heads_purged_after_export CHECK (purged_seq <= exported_seq AND exported_seq <= seq)
);

-- When each requestor was last audited retrieving a finished task, and how often since: repeated
-- retrievals are recorded once per interval (docs/decisions.md). Gone with the task: no foreign
-- key (its lock and check cost a first retrieval more than the rest of it, migration 0013), but the
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
-- of the event's fields (migration 0001), written directly (migration 0020): keys in jsonb's order
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
-- repeats counted into the next event (migration 0003, docs/decisions.md). Returns NULL when this
-- hand-out is only counted, else how many were counted since the last recorded one. A first
-- hand-out inserts the requestor's row; else that row, locked, decides (migration 0013). Called
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

-- Append one event to its tenant's chain (one round trip, in the caller's transaction). The head
-- is read first and created only for a tenant's first event.
CREATE FUNCTION audit_append(
    p_tenant text, p_action text, p_outcome text, p_subject text, p_client_id text, p_issuer text,
    p_task_id text, p_request_id text, p_client_address text, p_detail jsonb
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    head audit_heads;
    e audit_events;
    repeats bigint;
BEGIN
    -- Row-level security held the request role to its tenant; this function runs as its owner.
    IF current_setting('role') = 'mcp_tasks_app' AND p_tenant IS DISTINCT FROM current_setting('app.tenant_id', true) THEN
        RAISE EXCEPTION 'audit_append: % is not the transaction''s tenant', p_tenant
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF p_action = 'retrieve' AND p_task_id IS NOT NULL THEN
        repeats := audit_retrieval_due(p_tenant, p_task_id, coalesce(p_subject, ''));
        IF repeats IS NULL THEN
            RETURN NULL;
        END IF;
        IF repeats > 0 THEN
            p_detail := coalesce(p_detail, '{}') || jsonb_build_object('repeats_before', repeats);
        END IF;
    END IF;
    SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    IF NOT FOUND THEN  -- the tenant's first event
        INSERT INTO audit_heads (tenant_id, seq, hash) VALUES (p_tenant, 0, decode(repeat('00', 32), 'hex'))
            ON CONFLICT (tenant_id) DO NOTHING;
        SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    END IF;
    e.tenant_id := p_tenant; e.seq := head.seq + 1; e.at := greatest(clock_timestamp(), head.at);
    e.action := p_action; e.outcome := p_outcome;
    e.subject := coalesce(p_subject, ''); e.client_id := coalesce(p_client_id, '');
    e.issuer := coalesce(p_issuer, ''); e.task_id := p_task_id; e.request_id := p_request_id;
    e.client_address := p_client_address; e.detail := p_detail; e.prev_hash := head.hash;
    e.hash := sha256(head.hash || convert_to(audit_canonical(e), 'UTF8'));
    INSERT INTO audit_events VALUES (e.*);
    UPDATE audit_heads SET seq = e.seq, hash = e.hash, at = e.at WHERE tenant_id = p_tenant;
    RETURN e.seq;
END
$$;
ALTER FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb) OWNER TO mcp_tasks_record;

-- One event for audit_append_many: audit_append's arguments but the tenant.
CREATE TYPE audit_event_item AS (
    action text, outcome text, subject text, client_id text, issuer text, task_id text,
    request_id text, client_address text, detail jsonb
);

-- Append a batch's events of one tenant, in order, as audit_append would one by one (the same
-- checks, retrieve interval, seq, time and hash), with the head locked, read and written once and
-- the rows inserted by one statement: a batch of one busy tenant updated its head row once per
-- event, and each lookup walked the versions the batch had left (issue 15, point 2).
CREATE FUNCTION audit_append_many(p_tenant text, p_events audit_event_item[]) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    head audit_heads;
    ev audit_event_item;
    kept audit_event_item[] := '{}';
    e audit_events;
    chain audit_events[] := '{}';
    repeats bigint;
    n integer := 0;
BEGIN
    IF current_setting('role') = 'mcp_tasks_app' AND p_tenant IS DISTINCT FROM current_setting('app.tenant_id', true) THEN
        RAISE EXCEPTION 'audit_append_many: % is not the transaction''s tenant', p_tenant
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- The retrieve intervals first, as audit_append decides them before it locks the head.
    FOREACH ev IN ARRAY coalesce(p_events, '{}') LOOP
        ev.subject := coalesce(ev.subject, '');
        IF ev.action = 'retrieve' AND ev.task_id IS NOT NULL THEN
            repeats := audit_retrieval_due(p_tenant, ev.task_id, ev.subject);
            CONTINUE WHEN repeats IS NULL;
            IF repeats > 0 THEN
                ev.detail := coalesce(ev.detail, '{}') || jsonb_build_object('repeats_before', repeats);
            END IF;
        END IF;
        n := n + 1;
        kept[n] := ev;
    END LOOP;
    IF n = 0 THEN
        RETURN NULL;
    END IF;
    SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    IF NOT FOUND THEN  -- the tenant's first event
        INSERT INTO audit_heads (tenant_id, seq, hash) VALUES (p_tenant, 0, decode(repeat('00', 32), 'hex'))
            ON CONFLICT (tenant_id) DO NOTHING;
        SELECT * INTO head FROM audit_heads WHERE tenant_id = p_tenant FOR UPDATE;
    END IF;
    e.tenant_id := p_tenant; e.seq := head.seq; e.hash := head.hash; e.at := head.at;
    FOR i IN 1 .. n LOOP
        ev := kept[i];
        e.seq := e.seq + 1; e.at := greatest(clock_timestamp(), e.at);
        e.action := ev.action; e.outcome := ev.outcome;
        e.subject := ev.subject; e.client_id := coalesce(ev.client_id, '');
        e.issuer := coalesce(ev.issuer, ''); e.task_id := ev.task_id; e.request_id := ev.request_id;
        e.client_address := ev.client_address; e.detail := ev.detail; e.prev_hash := e.hash;
        e.hash := sha256(e.prev_hash || convert_to(audit_canonical(e), 'UTF8'));
        chain[i] := e;
    END LOOP;
    IF n = 1 THEN  -- a batch's only event of this tenant: inserted as audit_append does (cheaper)
        INSERT INTO audit_events VALUES (e.*);
    ELSE
        INSERT INTO audit_events SELECT * FROM unnest(chain);
    END IF;
    UPDATE audit_heads SET seq = e.seq, hash = e.hash, at = e.at WHERE tenant_id = p_tenant;
    RETURN e.seq;
END
$$;
ALTER FUNCTION audit_append_many(text, audit_event_item[]) OWNER TO mcp_tasks_record;

-- Append a batch's events of many tenants: p_tenants[i] is the tenant of p_events[i]. Each tenant's
-- events go onto its chain in their order, as audit_append_many would append them (the same seq,
-- time and hash), with the events inserted by one statement and the heads written by one, where
-- per-tenant calls took a function call and three statements each. Locks: a tenant's missing head
-- is inserted before any head is locked, then the heads are locked in tenant order (COLLATE "C"),
-- as the per-tenant calls took them. Not for retrievals (their interval rows would be locked
-- before the heads, where audit_append_many locks a tenant's after the tenants' before it). Not
-- callable by the service's roles: only the record's own functions call it (task_finish_batch),
-- so it has no tenant check of its own (audit_append_many's applies to the app role only). A batch
-- of one tenant goes to audit_append_many, which costs less for one (migration 0019).
CREATE FUNCTION audit_append_all(p_tenants text[], p_events audit_event_item[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    n integer := coalesce(cardinality(p_events), 0);
    tenants text[];
    at_order integer[];
    head_tenant text[];
    head_seq bigint[];
    head_hash bytea[];
    head_at timestamptz[];
    ev audit_event_item;
    e audit_events;
    chain audit_events[] := '{}';
    h integer := 0;
    k integer;
    retrievals boolean;
BEGIN
    IF n = 0 THEN
        RETURN;
    ELSIF cardinality(p_tenants) IS DISTINCT FROM n OR array_lower(p_tenants, 1) <> 1 OR array_lower(p_events, 1) <> 1
          OR array_position(p_tenants, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'audit_append_all: one tenant for every event' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The events by tenant (in tenant order), each tenant's in their order; the tenants in order.
    SELECT array_agg(x.o ORDER BY x.t COLLATE "C", x.o), array_agg(DISTINCT x.t COLLATE "C" ORDER BY x.t COLLATE "C"),
           bool_or((p_events[x.o]).action = 'retrieve')
        INTO at_order, tenants, retrievals
    FROM unnest(p_tenants) WITH ORDINALITY AS x(t, o);
    IF retrievals THEN
        RAISE EXCEPTION 'audit_append_all: retrievals go through audit_append_many' USING ERRCODE = 'invalid_parameter_value';
    ELSIF cardinality(tenants) = 1 THEN
        PERFORM audit_append_many(tenants[1], p_events);
        RETURN;
    END IF;
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
    FOREACH k IN ARRAY at_order LOOP
        IF h = 0 OR e.tenant_id <> p_tenants[k] THEN  -- the next tenant's chain
            IF h > 0 THEN
                head_seq[h] := e.seq; head_hash[h] := e.hash; head_at[h] := e.at;
            END IF;
            h := h + 1;
            IF head_tenant[h] IS DISTINCT FROM p_tenants[k] THEN  -- never append to another chain
                RAISE EXCEPTION 'audit_append_all: no head for tenant %', p_tenants[k];
            END IF;
            e.tenant_id := head_tenant[h]; e.seq := head_seq[h]; e.hash := head_hash[h]; e.at := head_at[h];
        END IF;
        ev := p_events[k];
        e.seq := e.seq + 1; e.at := greatest(clock_timestamp(), e.at);
        e.action := ev.action; e.outcome := ev.outcome;
        e.subject := coalesce(ev.subject, ''); e.client_id := coalesce(ev.client_id, '');
        e.issuer := coalesce(ev.issuer, ''); e.task_id := ev.task_id; e.request_id := ev.request_id;
        e.client_address := ev.client_address; e.detail := ev.detail; e.prev_hash := e.hash;
        e.hash := sha256(e.prev_hash || convert_to(audit_canonical(e), 'UTF8'));
        chain[cardinality(chain) + 1] := e;
    END LOOP;
    head_seq[h] := e.seq; head_hash[h] := e.hash; head_at[h] := e.at;
    INSERT INTO audit_events SELECT * FROM unnest(chain);
    -- Each head by key (ANY), whatever plan a join of the heads with an array would get.
    UPDATE audit_heads
    SET seq = head_seq[array_position(head_tenant, tenant_id)], hash = head_hash[array_position(head_tenant, tenant_id)],
        at = head_at[array_position(head_tenant, tenant_id)]
    WHERE tenant_id = ANY (head_tenant);
END
$$;
ALTER FUNCTION audit_append_all(text[], audit_event_item[]) OWNER TO mcp_tasks_record;

-- `mcp-tasks audit export` read a tenant's chain from its start up to p_seq: those rows may be purged.
CREATE FUNCTION audit_mark_exported(p_tenant text, p_seq bigint) RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, public
BEGIN ATOMIC
    UPDATE audit_heads SET exported_seq = greatest(exported_seq, least(p_seq, seq))
    WHERE tenant_id = p_tenant
    RETURNING exported_seq;
END;
ALTER FUNCTION audit_mark_exported(text, bigint) OWNER TO mcp_tasks_record;

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
    audit_append_many(text, audit_event_item[]), audit_append_all(text[], audit_event_item[]),
    audit_retrieval_due(text, text, text), audit_mark_exported(text, bigint), audit_purge(text, timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION audit_append(text, text, text, text, text, text, text, text, text, jsonb),
    audit_append_many(text, audit_event_item[]), audit_canonical(audit_events) TO mcp_tasks_app, mcp_tasks_runner;
GRANT USAGE ON TYPE audit_event_item TO mcp_tasks_app, mcp_tasks_runner;
GRANT EXECUTE ON FUNCTION audit_mark_exported(text, bigint), audit_purge(text, timestamptz) TO mcp_tasks_runner;

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


-- ================================================================= hot paths: group commit ==
-- task_batch creates, gets and retrieves (auditing a terminal task's hand-out) for a whole batch
-- of requests from many tenants and requestors, and task_finish_batch records many runner
-- outcomes (see service/store/batch.py): under load, a round trip, a statement and a durable
-- commit are shared by many requests, and the listening replicas are woken once per commit. A
-- single request is a batch of one: there is one implementation per operation.
--
-- Locks are taken in the order every other writer takes them, so batches deadlock neither with
-- each other nor with single statements: the tenants' create locks (sorted), then the tasks' rows,
-- then their requestors' counters in (tenant, subject, task) order (the caller sorts the batch; a
-- finish batch locks all its rows before it changes any), then the tenants' audit heads, in tenant
-- order. Every such order compares code points (COLLATE "C", as Python sorts), whatever the
-- database's collation. Each item sets its own tenant before it touches a table, so row-level
-- security applies per item exactly as it would to a statement of its own.
--
-- The results come back one row per item, in the order of the items; a row of NULLs means "no
-- task": a cap refused the create, or the task is unknown, expired or someone else's.

-- One request of a batch: k is 'create', 'retrieve' or 'get'; a create uses every field.
CREATE TYPE task_batch_item AS (
    k text, tenant_id text, task_id text, subject text, issuer text, client_id text, session_id text,
    surface text, tool text, arguments jsonb, client_capabilities jsonb, progress_token jsonb,
    ttl_ms bigint, poll_interval_ms integer, max_per_requestor bigint, max_per_tenant bigint,
    request_id text, client_address text, detail jsonb,
    lease_owner text, lease_key bigint, lease_ms bigint, rerunnable boolean, tool_version text
);

CREATE FUNCTION task_batch(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_batch_item[];
    it task_batch_item;
    found_tasks tasks[];
    t tasks;
    lock_tenant text;
    mine bigint;
    total bigint;
    counted_tenant text;
    counted_subject text;
    n integer;
    -- The current tenant's creates that passed the caps, not inserted yet, and their places.
    pending task_batch_item[] := '{}';
    pending_at integer[] := '{}';
    pending_ids text[] := '{}';
    pending_tenant text;
    inserted tasks[];
    -- The audit events in item order, and the tenant of each.
    events audit_event_item[] := '{}';
    event_tenants text[] := '{}';
    n_events integer := 0;
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_batch_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    -- The create locks of every tenant that creates, in tenant order, held until commit.
    FOR lock_tenant IN
        SELECT DISTINCT u.tenant_id COLLATE "C" FROM unnest(items) u WHERE u.k = 'create' ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended('mcp_tasks:create:' || lock_tenant, 0));
    END LOOP;
    -- The rows, in the caller's (tenant, subject, task) order. A tenant's creates go in as one
    -- INSERT when the next tenant's first create comes (or the items end: the extra pass), so the
    -- counter trigger (a statement trigger) changes each requestor's counter once, not once per
    -- task. Row-level security checks every row against the tenant set for the INSERT: its own.
    FOR i IN 1 .. n + 1 LOOP
        IF cardinality(pending) > 0 AND (i > n OR (items[i].k = 'create' AND items[i].tenant_id IS DISTINCT FROM pending_tenant)) THEN
            PERFORM set_config('app.tenant_id', pending_tenant, true);
            IF cardinality(pending) = 1 THEN  -- one create of this tenant: a plain INSERT costs less
                it := pending[1];
                INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool,
                                   arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                   expires_at, lease_owner, lease_key, lease_expires_at, attempts, started_at,
                                   rerunnable, tool_version)
                VALUES (it.tenant_id, it.task_id, it.subject, it.issuer, it.client_id, it.session_id, it.surface,
                        it.tool, it.arguments, it.client_capabilities, it.progress_token, it.ttl_ms,
                        it.poll_interval_ms, clock_timestamp() + it.ttl_ms * interval '1 millisecond',
                        it.lease_owner, it.lease_key, clock_timestamp() + it.lease_ms * interval '1 millisecond',
                        CASE WHEN it.lease_owner IS NULL THEN 0 ELSE 1 END,
                        CASE WHEN it.lease_owner IS NULL THEN NULL ELSE clock_timestamp() END,
                        it.rerunnable, it.tool_version)
                RETURNING * INTO t;
                found_tasks[pending_at[1]] := t;
            ELSE
            WITH ins AS (
                INSERT INTO tasks (tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool,
                                   arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms,
                                   expires_at, lease_owner, lease_key, lease_expires_at, attempts, started_at,
                                   rerunnable, tool_version)
                SELECT p.tenant_id, p.task_id, p.subject, p.issuer, p.client_id, p.session_id, p.surface,
                       p.tool, p.arguments, p.client_capabilities, p.progress_token, p.ttl_ms,
                       p.poll_interval_ms, clock_timestamp() + p.ttl_ms * interval '1 millisecond',
                       p.lease_owner, p.lease_key, clock_timestamp() + p.lease_ms * interval '1 millisecond',
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
        t := NULL;
        PERFORM set_config('app.tenant_id', it.tenant_id, true);
        IF it.k = 'create' THEN
            -- The counters are read once per run of one requestor's creates (the batch is sorted),
            -- plus this tenant's creates not inserted yet, and counted on here: the tenant's create
            -- lock keeps other creates out, a finish committed meanwhile only lowers them.
            IF counted_tenant IS DISTINCT FROM it.tenant_id OR counted_subject IS DISTINCT FROM it.subject THEN
                SELECT coalesce(sum(active) FILTER (WHERE subject = it.subject), 0), coalesce(sum(active), 0)
                    INTO mine, total
                FROM active_tasks WHERE tenant_id = it.tenant_id AND active > 0;
                total := total + cardinality(pending);
                FOR j IN 1 .. cardinality(pending) LOOP
                    IF pending[j].subject = it.subject THEN
                        mine := mine + 1;
                    END IF;
                END LOOP;
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
        ELSIF it.k IN ('retrieve', 'get') THEN
            -- Only what a lookup answers with: not the arguments nor the client's capabilities,
            -- which every poll of a running task would otherwise read and send (issue 14 #4). By
            -- primary key alone, then the owner and the expiry checked here: with the subject in
            -- the WHERE the planner may take tasks_owner_recent (tenant, subject, ..., task_id) and
            -- walk every task of the subject (6,400 index entries for one busy principal).
            SELECT tenant_id, task_id, subject, issuer, client_id, session_id, surface, tool, progress_token,
                   status, status_message, outcome, payload, ttl_ms, poll_interval_ms, created_at,
                   last_updated_at, attempts, expires_at
            INTO t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.surface, t.tool,
                 t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
                 t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at
            FROM tasks
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id;
            IF t.task_id IS NOT NULL AND (t.subject <> it.subject OR NOT t.expires_at > clock_timestamp()) THEN
                t := NULL;
            END IF;
        ELSE
            RAISE EXCEPTION 'unknown batch item kind %', it.k USING ERRCODE = 'invalid_parameter_value';
        END IF;
        found_tasks[i] := t;
    END LOOP;
    -- Then the audit events: collected in item order, appended once per tenant in tenant order
    -- (audit heads after counters, as every writer).
    FOR i IN 1 .. n LOOP
        it := items[i];
        t := found_tasks[i];
        CONTINUE WHEN t.task_id IS NULL;
        IF it.k = 'create' THEN
            n_events := n_events + 1;
            event_tenants[n_events] := it.tenant_id;
            events[n_events] := ROW('create', 'working', it.subject, it.client_id, it.issuer, it.task_id,
                                    it.request_id, it.client_address, it.detail)::audit_event_item;
            IF it.lease_owner IS NULL THEN
                PERFORM pg_notify('mcp_tasks', json_build_object(
                    'v', 1, 'k', 'created', 'tenant_id', it.tenant_id, 'task_id', it.task_id)::text);
            END IF;
        ELSIF it.k = 'retrieve' AND NOT task_status_active(t.status) THEN
            n_events := n_events + 1;
            event_tenants[n_events] := it.tenant_id;
            events[n_events] := ROW('retrieve', t.status::text, it.subject, it.client_id, it.issuer, it.task_id,
                                    it.request_id, it.client_address, NULL)::audit_event_item;
        END IF;
    END LOOP;
    FOR lock_tenant IN SELECT DISTINCT x.tenant COLLATE "C" FROM unnest(event_tenants) AS x(tenant) ORDER BY 1 LOOP
        PERFORM set_config('app.tenant_id', lock_tenant, true);
        PERFORM audit_append_many(lock_tenant, ARRAY(
            SELECT events[x.o] FROM unnest(event_tenants) WITH ORDINALITY AS x(tenant, o)
            WHERE x.tenant = lock_tenant ORDER BY x.o));
    END LOOP;
    FOR i IN 1 .. n LOOP
        RETURN NEXT found_tasks[i];
    END LOOP;
END
$$;

-- One runner outcome of a batch.
-- epoch: the lease_epoch the runner was given; NULL (a release before fencing) checks the owner only.
CREATE TYPE task_finish_item AS (
    tenant_id text, task_id text, owner text, status task_status, outcome text, payload jsonb,
    status_message text, detail jsonb, epoch bigint
);

CREATE FUNCTION task_finish_batch(p_items jsonb) RETURNS SETOF tasks
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
    -- cancel locks its row before that requestor's counter. One statement for them all (migration
    -- 0014): each item's row by primary key, locked in the items' order (a lateral lookup per item,
    -- in the order unnest gives them; a join could be planned, and cached, as a scan of the table).
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
            lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
        FROM unnest(items) WITH ORDINALITY AS u
        WHERE t.tenant_id = u.tenant_id AND t.task_id = u.task_id AND t.lease_owner = u.owner
          AND (u.epoch IS NULL OR t.lease_epoch = u.epoch) AND task_status_active(t.status)
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
        PERFORM audit_append_all(event_tenants, events);
    END IF;
    FOR i IN 1 .. n LOOP
        RETURN NEXT done_tasks[i];
    END LOOP;
END
$$;

REVOKE ALL ON FUNCTION task_batch(jsonb), task_finish_batch(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION task_batch(jsonb) TO mcp_tasks_app;
GRANT EXECUTE ON FUNCTION task_finish_batch(jsonb) TO mcp_tasks_runner;
GRANT USAGE ON TYPE task_batch_item TO mcp_tasks_app;
GRANT USAGE ON TYPE task_finish_item TO mcp_tasks_runner;
-- Outcomes are the record: the function runs as mcp_tasks_record, the only role that may write a
-- task's outcome columns; the lease check in its body decides which rows it may finish.
ALTER FUNCTION task_finish_batch(jsonb) OWNER TO mcp_tasks_record;
-- Its statements find the items' rows in tasks: planned on a young table (and cached for the
-- connection), a hash join or a scan read every task for every batch after. Without hash and merge
-- joins and sequential scans each item's row is found by key however the table has grown (0014).
ALTER FUNCTION task_finish_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public
    SET enable_hashjoin = off SET enable_mergejoin = off SET enable_seqscan = off;

-- task_get_batch reads a batch of gets (migrations 0010, 0011): one set-based read per tenant, under
-- that tenant's row-level security, each row by primary key; a row per item found (its place in
-- ``o``), nothing for the others.
CREATE FUNCTION task_get_batch(p_tenants text[], p_task_ids text[], p_subjects text[])
RETURNS TABLE (o integer, tenant_id text, task_id text, subject text, issuer text, client_id text,
               session_id text, surface text, tool text, progress_token jsonb, status task_status,
               status_message text, outcome text, payload jsonb, ttl_ms bigint, poll_interval_ms integer,
               created_at timestamptz, last_updated_at timestamptz, attempts integer, expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    tenant text;
BEGIN
    -- One set-based read per tenant of the batch, under that tenant's row-level security; each
    -- item's row by primary key alone (a subquery kept whole by OFFSET 0: with the subject among
    -- its conditions the planner may walk tasks_owner_recent, every task of the subject), then
    -- kept when it is the item's subject's and unexpired, with the item's place.
    FOR tenant IN SELECT DISTINCT u FROM unnest(p_tenants) AS u LOOP
        PERFORM set_config('app.tenant_id', tenant, true);
        RETURN QUERY
        SELECT w.o::integer, t.tenant_id, t.task_id, t.subject, t.issuer, t.client_id, t.session_id, t.surface,
               t.tool, t.progress_token, t.status, t.status_message, t.outcome, t.payload, t.ttl_ms,
               t.poll_interval_ms, t.created_at, t.last_updated_at, t.attempts, t.expires_at
        FROM unnest(p_tenants, p_task_ids, p_subjects) WITH ORDINALITY AS w(tenant_id, task_id, subject, o)
        CROSS JOIN LATERAL (
            SELECT k.tenant_id, k.task_id, k.subject, k.issuer, k.client_id, k.session_id, k.surface, k.tool,
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

REVOKE ALL ON FUNCTION task_get_batch(text[], text[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION task_get_batch(text[], text[], text[]) TO mcp_tasks_app;

-- ================================================================ hot paths: hand-back ==
-- A runner gave a task back (it stopped, or its lease was lost and the reaper found it): run it
-- again if its tool may re-run and attempts remain, else fail it. The one hand-back path, for
-- the reaper and a stopping runner alike; rows locked first in the caller's order, as finishes.
-- epoch: the lease_epoch the releaser saw (NULL: the owner only, as before fencing);
-- only_if_lapsed: the reaper's release, which acts only on a lease whose time has run out.
CREATE TYPE task_release_item AS (
    tenant_id text, task_id text, owner text, rerunnable boolean, max_attempts integer,
    requeue_message text, failure jsonb, epoch bigint, only_if_lapsed boolean
);

CREATE FUNCTION task_release_batch(p_items jsonb) RETURNS SETOF tasks
LANGUAGE plpgsql AS $$
DECLARE
    items task_release_item[];
    it task_release_item;
    moved tasks[];
    requeued boolean[];
    t tasks;
    n integer;
BEGIN
    SELECT array_agg(jsonb_populate_record(NULL::task_release_item, e) ORDER BY o) INTO items
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
    n := coalesce(array_length(items, 1), 0);
    -- Every row first, in the caller's order, by one statement (as task_finish_batch).
    PERFORM 1 FROM unnest(items) WITH ORDINALITY AS u
    CROSS JOIN LATERAL (SELECT 1 FROM tasks k WHERE k.tenant_id = u.tenant_id AND k.task_id = u.task_id
                        FOR NO KEY UPDATE) l;
    FOR i IN 1 .. n LOOP
        it := items[i];
        t := NULL;
        requeued[i] := false;
        UPDATE tasks
        SET status = 'working', status_message = format('%s (attempt %s)', it.requeue_message, attempts + 1),
            last_updated_at = clock_timestamp(), lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL,
            lease_epoch = lease_epoch + 1
        WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
          AND (it.epoch IS NULL OR lease_epoch = it.epoch)
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
                lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
              AND (it.epoch IS NULL OR lease_epoch = it.epoch)
              AND (it.only_if_lapsed IS NOT TRUE OR lease_lapsed(lease_owner, lease_expires_at))
              AND task_status_active(status)
            RETURNING * INTO t;
        END IF;
        moved[i] := t;
    END LOOP;
    FOR i IN 1 .. n LOOP
        t := moved[i];
        CONTINUE WHEN t.task_id IS NULL;
        IF requeued[i] THEN
            PERFORM audit_append(t.tenant_id, 'requeue', 'working', t.subject, t.client_id, t.issuer, t.task_id,
                                 NULL, NULL, jsonb_build_object('attempt', t.attempts + 1, 'owner', items[i].owner));
            PERFORM pg_notify('mcp_tasks', json_build_object(
                'v', 1, 'k', 'created', 'tenant_id', t.tenant_id, 'task_id', t.task_id)::text);
        ELSE
            PERFORM audit_append(t.tenant_id, 'complete', 'failed', t.subject, t.client_id, t.issuer, t.task_id,
                                 NULL, NULL, jsonb_build_object('kind', 'failure',
                                                                'reason', items[i].failure ->> 'reason'));
        END IF;
        PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', t.tenant_id,
                                                         'task_id', t.task_id, 'session_id', t.session_id)::text);
    END LOOP;
    FOR i IN 1 .. n LOOP
        RETURN NEXT moved[i];
    END LOOP;
END
$$;

REVOKE ALL ON FUNCTION task_release_batch(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION task_release_batch(jsonb) TO mcp_tasks_runner;
GRANT USAGE ON TYPE task_release_item TO mcp_tasks_runner;
ALTER FUNCTION task_release_batch(jsonb) OWNER TO mcp_tasks_record;
ALTER FUNCTION task_release_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;


-- =============================================================================== maintenance ==
-- The planner's statistics, when the server's autovacuum (which keeps them) is off: the
-- maintenance pass calls this then, and it analyses each of the service's tables whose rows
-- changed since its last analysis by more than autovacuum's default threshold (50 rows and 10 %),
-- at most once per p_every per table (a minute: autovacuum's naptime).
-- Without statistics a lookup of one task by (tenant_id, task_id) may walk every task of the
-- tenant in tasks_owner_recent (or, until migration 0015, tasks_active_owner; migration 0012). Owned by the schema's owner
-- (ANALYZE needs the table's owner); it does nothing else.
CREATE FUNCTION analyze_stale_tables(p_every interval) RETURNS text[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    stale text;
    analysed text[] := '{}';
BEGIN
    -- One process at a time; another that finds it taken has nothing to add. Every call qualified
    -- and typed exactly, so nothing created in public can stand in for it (migration 0016).
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

-- The first statistics of a new deployment's tables, whatever autovacuum does (migration 0016): each
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
