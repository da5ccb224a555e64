"""A first retrieval's audit interval is remembered without a foreign key.

Revision ID: 0013
Revises: 0012

``audit_retrieval_due`` (migration 0003) remembered a requestor's first hand-out of a finished task
in ``audit_retrievals``, whose foreign key to ``tasks`` made the row go with its task (cascade).
That cost every first retrieval a key-share lock on the task's row (a tuple lock: a WAL record and a
dirtied page), the foreign key's own check (a second lookup of the task through SPI) and a locked
lookup before the insert: about 36 us of PostgreSQL CPU per retrieval of a batch
(``bench/sql_cpu.py``: 117 -> 80 us per item for one requestor, 139 -> 103 spread; medians of four
alternated runs), a retrieval being one of each task lifecycle's three audited writes (issue 15).

Now the row is inserted first (``ON CONFLICT DO NOTHING``: a row already there, or being inserted
by another transaction, which is waited for, decides as before), with no foreign key, and a
statement trigger on ``tasks`` deletes the rows of the tasks a statement deleted (the sweeper's
batches), running as ``mcp_tasks_record``, the only role that may touch them. What a requestor
is audited for does not change: the first hand-out of every result is recorded, repeats within
the interval are counted into the next recorded one.

One difference: a retrieval that races its task's deletion at expiry (the task read as unexpired,
deleted before the retrieval's insert) leaves its memo row behind, where the foreign key made the
retrieval wait and then remember nothing. The row is about 100 bytes, names a random task id that
is never reused, and is never read again.
"""

from service.store.sqlscript import run_script

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE audit_retrievals DROP CONSTRAINT audit_retrievals_task_fkey;
GRANT DELETE ON audit_retrievals TO mcp_tasks_record;

CREATE OR REPLACE FUNCTION audit_retrieval_due(p_tenant text, p_task_id text, p_subject text) RETURNS bigint
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
"""

DOWNGRADE = """
DROP TRIGGER tasks_forget_retrievals ON tasks;
DROP FUNCTION tasks_forget_retrievals();
-- The rows a retrieval racing its task's deletion left behind would fail the foreign key; only
-- mcp_tasks_record sees them (row-level security applies to the schema's owner too).
SET ROLE mcp_tasks_record;
DELETE FROM audit_retrievals r WHERE NOT EXISTS (
    SELECT FROM tasks t WHERE t.tenant_id = r.tenant_id AND t.task_id = r.task_id);
RESET ROLE;
REVOKE DELETE ON audit_retrievals FROM mcp_tasks_record;
ALTER TABLE audit_retrievals ADD CONSTRAINT audit_retrievals_task_fkey FOREIGN KEY (tenant_id, task_id)
    REFERENCES tasks (tenant_id, task_id) ON DELETE CASCADE;
CREATE OR REPLACE FUNCTION audit_retrieval_due(p_tenant text, p_task_id text, p_subject text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    every_s double precision :=
        coalesce(nullif(current_setting('mcp_tasks.audit_retrieve_interval_s', true), ''), '3600')::double precision;
    seen audit_retrievals;
BEGIN
    IF every_s <= 0 THEN
        RETURN 0;
    END IF;
    SELECT * INTO seen FROM audit_retrievals
    WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM 1 FROM tasks WHERE tenant_id = p_tenant AND task_id = p_task_id FOR KEY SHARE;
        IF NOT FOUND THEN  -- the task is gone: recorded, and nothing to remember it by
            RETURN 0;
        END IF;
        INSERT INTO audit_retrievals (tenant_id, task_id, subject, audited_at, repeats)
        VALUES (p_tenant, p_task_id, p_subject, clock_timestamp(), 0)
        ON CONFLICT (tenant_id, task_id, subject) DO NOTHING;
        IF FOUND THEN
            RETURN 0;
        END IF;
        -- Another transaction's first hand-out inserted it meanwhile: its row decides.
        SELECT * INTO seen FROM audit_retrievals
        WHERE tenant_id = p_tenant AND task_id = p_task_id AND subject = p_subject FOR UPDATE;
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
"""


def upgrade() -> None:
    run_script(UPGRADE)


def downgrade() -> None:
    run_script(DOWNGRADE)
