"""The service analyses its own tables when the server's autovacuum is off.

Revision ID: 0012
Revises: 0011

The planner's statistics come from ANALYZE, which autovacuum runs as tables change. A server with
``autovacuum = off`` (the service warns about it at start) never has any for our tables, and a
planner that knows nothing takes any index whose columns match: a lookup of one task by
``(tenant_id, task_id)`` may walk ``tasks_owner_recent`` (tenant, subject, created_at, task_id) or
``tasks_active_owner`` through every task of the tenant. Measured on such a server with 6,400
queued tasks of one tenant: finishing a task cost 4.7 ms of PostgreSQL CPU instead of 0.2-0.4,
and a batch of gets 11 ms instead of 0.5 (0011 made gets immune; the others are not).

``analyze_stale_tables(every)`` analyses each of the service's tables whose rows changed, since its
last analysis, by more than autovacuum's own default threshold (50 rows and 10 % of the table),
at most once per ``p_every`` per table (the service passes a minute, autovacuum's naptime), one process at a time (the others skip),
and returns their names. It runs as the schema's owner
(ANALYZE needs the table's owner) and does nothing else; the runner role may call it. The
maintenance pass calls it only when the server's autovacuum is off.
"""

from service.store.sqlscript import run_script

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

ANALYZE_STALE = """
CREATE FUNCTION analyze_stale_tables(p_every interval) RETURNS text[]
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
REVOKE ALL ON FUNCTION analyze_stale_tables(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION analyze_stale_tables(interval) TO mcp_tasks_runner;
"""


def upgrade() -> None:
    run_script(ANALYZE_STALE)


def downgrade() -> None:
    run_script("DROP FUNCTION analyze_stale_tables(interval);")
