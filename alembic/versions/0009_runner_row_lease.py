"""A runner's heartbeat renews one row, not the lease of every task it runs (issue 15, point 2).

Revision ID: 0009
Revises: 0008

A runner renewed the lease of every task it ran every eighth of the lease (3.75 s by default): one
UPDATE of every running row, each a new row version with an entry in every index of ``tasks``. With
6,400 long tasks running (an extension call that outlives its grace goes on running where it was
called, a task per call) that was 0.65-0.7 s of PostgreSQL per heartbeat, 110 us per row, about
half the database's statement time under a steady ``tasks/get`` load, and it grows with the tasks
held, not with the work done.

A lease now holds while both hold: the task's own ``lease_expires_at``, set for four leases and
renewed by its runner only once it is a lease old, and the runner's row in ``runners``, whose
``live_until`` the heartbeat extends for all its tasks at once, and never revives once it has
lapsed. ``lease_lapsed`` is that rule, for the release function's re-check under the row lock
(``find_lost_leases`` writes it as a set). The runner's reckoning (self-fencing) is unchanged: it
stops a run not covered by a successful heartbeat for three quarters of a lease.

During the rolling upgrade: the row counts only for owners whose name ends in ``+row`` (this
release's runners). A runner of the previous release fences on its per-task renewals and
republishes its row only now and then, so it is judged by its tasks' own leases alone, as before.
A reaper of the previous release reads only ``lease_expires_at``, so it takes a crashed new
runner's tasks after four leases instead of one.
"""

from service.store.sqlscript import run_script

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

LAPSED = """
GRANT SELECT ON runners TO mcp_tasks_record;
CREATE POLICY runners_record_reads ON runners FOR SELECT TO mcp_tasks_record
    USING (current_user = 'mcp_tasks_record');

CREATE FUNCTION lease_lapsed(p_owner text, p_expires_at timestamptz) RETURNS boolean
LANGUAGE sql VOLATILE
RETURN p_expires_at < clock_timestamp()
    OR (p_owner LIKE '%+row'
        AND NOT EXISTS (SELECT 1 FROM runners r WHERE r.owner = p_owner AND r.live_until > clock_timestamp()));
"""

RELEASE_NEW = """
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
"""

RELEASE_OLD = """
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
"""


# CREATE OR REPLACE resets these (its owner, mcp_tasks_record, stays).
DEFINER = """
ALTER FUNCTION task_release_batch(jsonb) SECURITY DEFINER SET search_path = pg_catalog, public;
"""


def upgrade() -> None:
    run_script(LAPSED + RELEASE_NEW + DEFINER)


def downgrade() -> None:
    run_script(RELEASE_OLD + DEFINER + """
    DROP FUNCTION lease_lapsed(text, timestamptz);
    DROP POLICY runners_record_reads ON runners;
    REVOKE SELECT ON runners FROM mcp_tasks_record;
    """)
