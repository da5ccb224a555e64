"""Fencing of runners (issue 13, point 2): every outcome write carries the runner's fencing token.

Revision ID: 0004
Revises: 0003

- ``tasks.lease_epoch``: with ``lease_owner`` the fencing token. It grows whenever the lease changes
  hands: a claim (claim_tasks) and a hand-back (task_release_batch, by a runner or the reaper).
- ``task_finish_item.epoch`` and ``task_release_item.epoch``: a finish or a release acts only while
  owner and epoch both match; NULL (the previous release, during a rolling upgrade) checks the
  owner only, as before.
- ``task_release_item.only_if_lapsed``: the reaper's release re-checks, under the row lock, that
  the lease's time has run out (a lock that is gone no longer lets it take a lease).
"""


from service.store.sqlscript import run_script

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    ALTER TABLE tasks ADD COLUMN lease_epoch bigint NOT NULL DEFAULT 0;
    ALTER TYPE task_finish_item ADD ATTRIBUTE epoch bigint;
    ALTER TYPE task_release_item ADD ATTRIBUTE epoch bigint, ADD ATTRIBUTE only_if_lapsed boolean;

    CREATE OR REPLACE FUNCTION task_finish_batch(p_items jsonb) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        items task_finish_item[];
        it task_finish_item;
        done_tasks tasks[];
        done tasks;
        n integer;
    BEGIN
        SELECT array_agg(jsonb_populate_record(NULL::task_finish_item, e) ORDER BY o) INTO items
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
        n := coalesce(array_length(items, 1), 0);
        -- Every row first, in the caller's (tenant, subject, task) order, before any counter: an
        -- UPDATE fires the counter trigger at once, and a cancel locks its row before that
        -- requestor's counter. One primary-key lookup each (a join would scan the table).
        FOR i IN 1 .. n LOOP
            PERFORM 1 FROM tasks WHERE tenant_id = items[i].tenant_id AND task_id = items[i].task_id
            FOR NO KEY UPDATE;
        END LOOP;
        FOR i IN 1 .. n LOOP
            it := items[i];
            done := NULL;
            UPDATE tasks
            SET status = it.status, outcome = it.outcome, payload = it.payload, status_message = it.status_message,
                last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
                lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
              AND (it.epoch IS NULL OR lease_epoch = it.epoch) AND task_status_active(status)
            RETURNING * INTO done;
            done_tasks[i] := done;
        END LOOP;
        FOR i IN 1 .. n LOOP
            done := done_tasks[i];
            CONTINUE WHEN done.task_id IS NULL;
            PERFORM audit_append(done.tenant_id, 'complete', done.status::text, done.subject, done.client_id,
                                 done.issuer, done.task_id, NULL, NULL, items[i].detail);
            PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', done.tenant_id,
                                                             'task_id', done.task_id, 'session_id', done.session_id)::text);
        END LOOP;
        FOR i IN 1 .. n LOOP
            RETURN NEXT done_tasks[i];
        END LOOP;
    END
    $$;

    CREATE OR REPLACE FUNCTION task_release_batch(p_items jsonb) RETURNS SETOF tasks
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
        FOR i IN 1 .. n LOOP
            PERFORM 1 FROM tasks WHERE tenant_id = items[i].tenant_id AND task_id = items[i].task_id
            FOR NO KEY UPDATE;
        END LOOP;
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
              AND (it.only_if_lapsed IS NOT TRUE OR lease_expires_at < clock_timestamp())
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
                  AND (it.only_if_lapsed IS NOT TRUE OR lease_expires_at < clock_timestamp())
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
    """)


def downgrade() -> None:
    run_script("""
    CREATE OR REPLACE FUNCTION task_finish_batch(p_items jsonb) RETURNS SETOF tasks
    LANGUAGE plpgsql AS $$
    DECLARE
        items task_finish_item[];
        it task_finish_item;
        done_tasks tasks[];
        done tasks;
        n integer;
    BEGIN
        SELECT array_agg(jsonb_populate_record(NULL::task_finish_item, e) ORDER BY o) INTO items
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(e, o);
        n := coalesce(array_length(items, 1), 0);
        -- Every row first, in the caller's (tenant, subject, task) order, before any counter: an
        -- UPDATE fires the counter trigger at once, and a cancel locks its row before that
        -- requestor's counter. One primary-key lookup each (a join would scan the table).
        FOR i IN 1 .. n LOOP
            PERFORM 1 FROM tasks WHERE tenant_id = items[i].tenant_id AND task_id = items[i].task_id
            FOR NO KEY UPDATE;
        END LOOP;
        FOR i IN 1 .. n LOOP
            it := items[i];
            done := NULL;
            UPDATE tasks
            SET status = it.status, outcome = it.outcome, payload = it.payload, status_message = it.status_message,
                last_updated_at = clock_timestamp(), finished_at = clock_timestamp(),
                lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
              AND task_status_active(status)
            RETURNING * INTO done;
            done_tasks[i] := done;
        END LOOP;
        FOR i IN 1 .. n LOOP
            done := done_tasks[i];
            CONTINUE WHEN done.task_id IS NULL;
            PERFORM audit_append(done.tenant_id, 'complete', done.status::text, done.subject, done.client_id,
                                 done.issuer, done.task_id, NULL, NULL, items[i].detail);
            PERFORM pg_notify('mcp_tasks', json_build_object('v', 1, 'k', 'status', 'tenant_id', done.tenant_id,
                                                             'task_id', done.task_id, 'session_id', done.session_id)::text);
        END LOOP;
        FOR i IN 1 .. n LOOP
            RETURN NEXT done_tasks[i];
        END LOOP;
    END
    $$;

    CREATE OR REPLACE FUNCTION task_release_batch(p_items jsonb) RETURNS SETOF tasks
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
        FOR i IN 1 .. n LOOP
            PERFORM 1 FROM tasks WHERE tenant_id = items[i].tenant_id AND task_id = items[i].task_id
            FOR NO KEY UPDATE;
        END LOOP;
        FOR i IN 1 .. n LOOP
            it := items[i];
            t := NULL;
            requeued[i] := false;
            UPDATE tasks
            SET status = 'working', status_message = format('%s (attempt %s)', it.requeue_message, attempts + 1),
                last_updated_at = clock_timestamp(), lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
            WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
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
                    lease_owner = NULL, lease_key = NULL, lease_expires_at = NULL
                WHERE tenant_id = it.tenant_id AND task_id = it.task_id AND lease_owner = it.owner
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

    ALTER TYPE task_release_item DROP ATTRIBUTE only_if_lapsed, DROP ATTRIBUTE epoch;
    ALTER TYPE task_finish_item DROP ATTRIBUTE epoch;
    ALTER TABLE tasks DROP COLUMN lease_epoch;
    """)
