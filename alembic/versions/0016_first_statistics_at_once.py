"""A new deployment's tables get their first statistics within a second of filling, autovacuum or not.

Revision ID: 0016
Revises: 0015

Until its first ANALYZE a table has no statistics, and a lookup of one task by
``(tenant_id, task_id)`` ties between the primary key and ``tasks_owner_recent``, which walks every
task of the tenant (migration 0012). Autovacuum analyses a table only at its naptime (a minute by
default) and the maintenance pass only every pass interval (5 s), and the plans a connection
caches meanwhile stay until that ANALYZE invalidates them: measured with ``bench/sql_cpu.py
--no-analyze``, a finished task of one busy requestor cost 456 µs of PostgreSQL CPU instead of 103,
a lease renewal 192 instead of 78.

``analyze_young_tables()`` analyses each of the service's tables that has no statistics yet and in
which at least 50 rows changed (autovacuum's base threshold), one process at a time, and returns one
row per table still without statistics when it was called: its name and whether this call analysed
it. The maintenance pass calls it every fraction of a second until ``tasks`` has statistics, then
never again in that process; whether autovacuum is on does not matter, and the later analyses stay
with autovacuum (or with ``analyze_stale_tables`` when it is off). Like that function it runs as the
schema's owner and does nothing else; the runner role may call it.
"""

from service.store.sqlscript import run_script

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE FUNCTION analyze_young_tables() RETURNS TABLE (relname text, analysed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
#variable_conflict use_column
DECLARE
    locked boolean := pg_try_advisory_xact_lock(hashtextextended('mcp_tasks:analyze', 0));
    young record;
BEGIN
    FOR young IN
        SELECT c.oid, c.relname::text AS name, s.n_mod_since_analyze >= 50 AS due
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_stat_user_tables s ON s.relid = c.oid
        WHERE c.oid IN ('tasks'::regclass, 'active_tasks'::regclass, 'task_messages'::regclass,
                        'sessions'::regclass, 'event_payloads'::regclass, 'runners'::regclass,
                        'audit_events'::regclass, 'audit_heads'::regclass, 'audit_retrievals'::regclass)
          -- No statistics: pg_stats shows the owner its tables' (pg_statistic is the superuser's).
          AND NOT EXISTS (SELECT 1 FROM pg_stats p WHERE p.schemaname = n.nspname AND p.tablename = c.relname)
        ORDER BY 2
    LOOP
        relname := young.name;
        -- Another process that holds the lock is analysing; this call reports the table as young.
        analysed := young.due AND locked;
        IF analysed THEN
            EXECUTE format('ANALYZE %I', young.name);
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
REVOKE ALL ON FUNCTION analyze_young_tables() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION analyze_young_tables() TO mcp_tasks_runner;
"""

DOWNGRADE = """
DROP FUNCTION analyze_young_tables();
"""


def upgrade() -> None:
    run_script(UPGRADE)


def downgrade() -> None:
    run_script(DOWNGRADE)
