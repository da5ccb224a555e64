"""A new deployment's tables get their first statistics seconds after they fill, autovacuum or not.

Revision ID: 0016
Revises: 0015

Until its first ANALYZE a table has no statistics, and a lookup of one task by
``(tenant_id, task_id)`` ties between the primary key and ``tasks_owner_recent``, which walks every
task of the tenant (migration 0012). Autovacuum analyses a table only at its naptime (a minute by
default) and the maintenance pass only every pass interval (5 s), and the plans a connection
caches meanwhile stay until that ANALYZE invalidates them: measured with ``bench/sql_cpu.py
--no-analyze``, a finished task of one busy requestor cost 456 µs of PostgreSQL CPU instead of 103,
a lease renewal 192 instead of 78.

``analyze_young_tables()`` analyses each of the service's tables that was never analysed (as the
server's counters say: ``pg_stats`` hides a table's statistics from an owner that row-level
security applies to) and in which more than 50 rows changed (autovacuum's base threshold), one
process at a time, and returns one row per table never analysed when it was called: its name,
whether this call analysed it and how many of its rows changed. The maintenance pass calls it at
every pass and, between passes, every 0.25 s while rows of ``tasks`` change (at most every second
while none do) until ``tasks`` has been analysed, then never again in that process; whether
autovacuum is on does not matter, and the later analyses stay with autovacuum (or with
``analyze_stale_tables`` when it is off). Like that function it runs as the schema's owner and does
nothing else, every call in it qualified and typed exactly; the runner role may call it.

``analyze_stale_tables`` gets the same care: its calls of ``hashtextextended``, ``format`` and
``=`` had closer matches a role allowed to create in ``public`` could plant there (every role, on
PostgreSQL 14), which the function would then have run as the schema's owner. And ``CREATE`` on
``public`` is revoked from everyone where the migrating role may (see REVOKE_PUBLIC_CREATE).
"""

from service.store.sqlscript import run_script

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

# A database only the service uses (its CONNECT is the service's roles' alone): nobody but its owner
# creates objects in public, where a function or operator created by the service's login could
# stand in for a built-in one that a SECURITY DEFINER function calls (PostgreSQL 14 lets every role
# create there). Takes effect where the migrating role may revoke it (public's owner, a superuser);
# PostgreSQL 15 and later revoke it by default. A downgrade leaves it revoked.
REVOKE_PUBLIC_CREATE = """
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
"""

STALE_HARDENED = """
CREATE OR REPLACE FUNCTION analyze_stale_tables(p_every interval) RETURNS text[]
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
"""

STALE_BEFORE = """
CREATE OR REPLACE FUNCTION analyze_stale_tables(p_every interval) RETURNS text[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    stale text;
    analysed text[] := '{}';
BEGIN
    -- One process at a time; another that finds it taken has nothing to add.
    IF NOT pg_try_advisory_xact_lock(hashtextextended('mcp_tasks:analyze', 0)) THEN
        RETURN analysed;
    END IF;
    FOR stale IN
        SELECT s.relname::text FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
        WHERE s.relid IN ('tasks'::regclass, 'active_tasks'::regclass, 'task_messages'::regclass,
                          'sessions'::regclass, 'event_payloads'::regclass, 'runners'::regclass,
                          'audit_events'::regclass, 'audit_heads'::regclass, 'audit_retrievals'::regclass)
          AND s.n_mod_since_analyze > 50 + 0.1 * greatest(c.reltuples, 0)
          -- At most once per p_every per table (the service: a minute, autovacuum's naptime).
          AND coalesce(greatest(s.last_analyze, s.last_autoanalyze), '-infinity') < clock_timestamp() - p_every
        ORDER BY 1
    LOOP
        EXECUTE format('ANALYZE %I', stale);
        analysed := analysed || stale;
    END LOOP;
    RETURN analysed;
END
$$;
"""

UPGRADE = """
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
"""

DOWNGRADE = """
DROP FUNCTION analyze_young_tables();
"""


def upgrade() -> None:
    run_script(REVOKE_PUBLIC_CREATE + STALE_HARDENED + UPGRADE)


def downgrade() -> None:
    run_script(DOWNGRADE + STALE_BEFORE)
