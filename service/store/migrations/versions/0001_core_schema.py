"""Core schema: tasks, task messages, sessions, service keys.

Revision ID: 0001
Revises:
"""

from alembic import op  # noqa: F401

from service.store.migrations.sqlscript import run_script

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    CREATE TYPE task_status AS ENUM ('working', 'input_required', 'completed', 'failed', 'cancelled');

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
        CONSTRAINT tasks_pkey PRIMARY KEY (tenant_id, task_id),
        CONSTRAINT tasks_surface_known CHECK (surface IN ('2025-11-25', '2026-07-28')),
        CONSTRAINT tasks_ttl_positive CHECK (ttl_ms > 0),
        CONSTRAINT tasks_outcome_matches_status CHECK (
               (status = 'completed' AND outcome = 'result' AND payload IS NOT NULL)
            OR (status = 'failed' AND outcome IN ('tool_error', 'rpc_error') AND payload IS NOT NULL)
            OR (status IN ('working', 'input_required', 'cancelled') AND outcome IS NULL AND payload IS NULL)
        ),
        CONSTRAINT tasks_lease_only_while_active CHECK (
            lease_owner IS NULL OR status IN ('working', 'input_required')
        ),
        CONSTRAINT tasks_lease_complete CHECK (
            (lease_owner IS NULL) = (lease_expires_at IS NULL) AND (lease_owner IS NULL) = (lease_key IS NULL)
        )
    );
    -- Runners claim from here: only unclaimed working rows, oldest first.
    CREATE INDEX tasks_claimable ON tasks (created_at) WHERE status = 'working' AND lease_owner IS NULL;
    -- The reaper scans leases that may have lapsed.
    CREATE INDEX tasks_leased ON tasks (lease_expires_at) WHERE lease_owner IS NOT NULL;
    -- tasks/list keyset pagination, newest first.
    CREATE INDEX tasks_owner_recent ON tasks (tenant_id, subject, created_at DESC, task_id DESC);
    -- Active-task caps per requestor.
    CREATE INDEX tasks_active_owner ON tasks (tenant_id, subject)
        WHERE status IN ('working', 'input_required');
    -- The sweeper deletes by expiry.
    CREATE INDEX tasks_expiry ON tasks (expires_at);

    -- Requests from a task to its client (elicitation) and the client's answers.
    CREATE TABLE task_messages (
        tenant_id    text        NOT NULL,
        task_id      text        NOT NULL,
        seq          integer     NOT NULL,
        rpc_id       text        NOT NULL,
        method       text        NOT NULL,
        params       jsonb       NOT NULL,
        delivered_to text,
        delivered_at timestamptz,
        answer       jsonb,
        answered_at  timestamptz,
        created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
        CONSTRAINT task_messages_pkey PRIMARY KEY (tenant_id, task_id, seq),
        CONSTRAINT task_messages_task_fkey FOREIGN KEY (tenant_id, task_id)
            REFERENCES tasks (tenant_id, task_id) ON DELETE CASCADE,
        CONSTRAINT task_messages_rpc_id_unique UNIQUE (tenant_id, rpc_id),
        CONSTRAINT task_messages_answer_complete CHECK ((answer IS NULL) = (answered_at IS NULL))
    );

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

    -- Server-wide secrets shared by all replicas (e.g. the tasks/list cursor key).
    CREATE TABLE service_keys (
        name       text        NOT NULL,
        secret     bytea       NOT NULL,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
        CONSTRAINT service_keys_pkey PRIMARY KEY (name),
        CONSTRAINT service_keys_secret_long CHECK (octet_length(secret) >= 32)
    );
    """)


def downgrade() -> None:
    run_script("""
    DROP TABLE service_keys;
    DROP TABLE sessions;
    DROP TABLE task_messages;
    DROP TABLE tasks;
    DROP TYPE task_status;
    """)
