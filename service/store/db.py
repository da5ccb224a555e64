"""Connection pool, transactions, and the one place driver errors become domain errors."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson

from service.domain.errors import InvalidArguments, Unavailable
from service.observability import metrics

log = logging.getLogger(__name__)

Connection = asyncpg.Connection
Record = asyncpg.Record

# Roles created by migration 0002: requests run tenant-scoped, runners across tenants.
APP_ROLE = "mcp_tasks_app"
RUNNER_ROLE = "mcp_tasks_runner"
# Migration 0027: the export path's (`mcp-tasks audit export` with its own login), never the service's.
EXPORTER_ROLE = "mcp_tasks_exporter"

# Errors that mean "the database is not there right now", as opposed to a bug in our SQL.
_UNAVAILABLE = (
    OSError,
    asyncpg.CannotConnectNowError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.PostgresConnectionError,  # SQLSTATE class 08: the connection failed
    asyncpg.InterfaceError,
    # A connection whose server end was killed mid-operation ("cannot switch to state ...;
    # another operation is in progress"): the pool drops it; the request may be retried.
    asyncpg.InternalClientError,
    asyncpg.TooManyConnectionsError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    TimeoutError,
)


# A lock wait that ran past lock_timeout (e.g. a tenant's create lock held elsewhere): the request
# is retried, like an outage, rather than holding its batch (and every tenant in it) any longer.
_LOCK_WAIT = asyncpg.LockNotAvailableError


# Input PostgreSQL refuses to store (e.g. U+0000 in text or jsonb): the caller's fault, not ours.
_UNSTORABLE = (asyncpg.CharacterNotInRepertoireError, asyncpg.UntranslatableCharacterError)


async def _check_role(conn: asyncpg.Connection, role: str) -> None:
    """Isolation rests on every statement running as the pool's role: refuse a connection that is not
    (e.g. a pooler that drops the role startup parameter)."""
    current = await conn.fetchval("SELECT current_user")
    if current != role:
        raise RuntimeError(
            f"database connection runs as {current!r}, not {role!r}: a connection pooler may be dropping the "
            "'role' startup parameter; connect directly or configure the pooler to keep it"
        )


def _literal(value: str) -> str:
    """``value`` as an escape-string literal: E'...' reads backslashes the same way whatever
    standard_conforming_strings says, so escaping the backslash and the quote is complete."""
    if "\x00" in value:
        raise InvalidArguments("strings must not contain the NUL character (U+0000)")
    return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


async def _no_reset(_conn: asyncpg.Connection) -> None:
    """Pooled connections carry no session state to undo: the role is a startup parameter, the
    tenant setting is transaction-local, LISTEN and session advisory locks use their own
    connections. asyncpg still rolls back an open transaction before calling this."""


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb",
        encoder=lambda v: b"\x01" + orjson.dumps(v),
        decoder=lambda b: orjson.loads(b[1:]),
        schema="pg_catalog",
        format="binary",
    )


def _gone(conn: asyncpg.Connection) -> bool:
    """Is this pooled connection closed, or already taken back by the pool (its server end went away)?"""
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        return True


class _Held:
    """The pooled connection one asyncio task keeps between its statements (Database.holding)."""

    __slots__ = ("busy", "conn", "db", "task")

    def __init__(self, db: Database, task: asyncio.Task[Any] | None) -> None:
        self.db = db
        self.task = task
        self.conn: asyncpg.Connection | None = None
        self.busy = False


_held: contextvars.ContextVar[_Held | None] = contextvars.ContextVar("mcp_tasks_held_connection", default=None)


class Database:
    """Owns the asyncpg pool; hands out transactions."""

    def __init__(
        self, dsn: str, *, pool_size: int, role: str | None = None, settings: dict[str, str] | None = None
    ) -> None:
        self.dsn = dsn
        self.role = role
        # Session defaults of every pooled connection (startup parameters, e.g. lock_timeout).
        self.settings = dict(settings or {})
        self._pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        # Metric label: the names the rest of the service uses for its two pools.
        self.name = {APP_ROLE: "app", RUNNER_ROLE: "runner", EXPORTER_ROLE: "exporter"}.get(role or "", "other")
        self._up = metrics.db_up.labels(self.name)
        self._acquire_seconds = metrics.db_acquire_seconds.labels(self.name)

    async def open(self) -> None:
        try:
            self._pool = await asyncpg.create_pool(
                self.dsn,
                min_size=1,
                max_size=self._pool_size,
                init=self._init,
                reset=_no_reset,  # saves the RESET ALL round trip on every release
                command_timeout=60,
                # The role is a startup parameter, so it is the session default and survives the
                # pool's RESET ALL: every statement runs as this role, under its RLS policies.
                server_settings={
                    "application_name": "mcp-tasks",
                    **self.settings,
                    **({"role": self.role} if self.role else {}),
                },
            )
        except _UNAVAILABLE as exc:
            self._up.set(0)
            raise Unavailable(f"cannot connect to PostgreSQL: {exc}") from exc
        except asyncpg.InsufficientPrivilegeError as exc:
            if self.role == EXPORTER_ROLE:
                raise RuntimeError(
                    f"the database user cannot act as {EXPORTER_ROLE}, the export path's role: run full exports "
                    f"with the export login in MCP_TASKS_DATABASE_URL (as the database owner: GRANT {EXPORTER_ROLE} "
                    "TO <the export login>, never to the service's own login; docs/operations.md, Retention), "
                    "or export with --since, which marks nothing"
                ) from exc
            raise RuntimeError(
                f"the database user cannot act as {self.role} ({exc}); as the database owner run: "
                f"GRANT {APP_ROLE}, {RUNNER_ROLE} TO <the user in MCP_TASKS_DATABASE_URL>"
            ) from exc
        self._up.set(1)
        metrics.watch_pool(self.name, self)

    async def _init(self, conn: asyncpg.Connection) -> None:
        await _init_connection(conn)
        if self.role:
            await _check_role(conn, self.role)

    async def close(self) -> None:
        metrics.unwatch_pool(self)
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise Unavailable("the database pool is not open")
        return self._pool

    @contextlib.asynccontextmanager
    async def transaction(self, tenant_id: str | None = None) -> AsyncIterator[asyncpg.Connection]:
        """One transaction on one pooled connection, scoped to ``tenant_id`` for row-level security.

        BEGIN and the tenant setting travel in one round trip (a simple-protocol query; the tenant
        is an escaped literal), COMMIT in another. Driver outages surface as ``Unavailable``.
        """
        begin = (
            "BEGIN" if tenant_id is None else f"BEGIN; SELECT set_config('app.tenant_id', {_literal(tenant_id)}, true)"
        )
        try:
            async with self._acquire() as conn:
                await conn.execute(begin)
                try:
                    yield conn
                except BaseException:
                    # If this fails or is cancelled too, the pool's release rolls back or drops the connection.
                    with contextlib.suppress(Exception):
                        await conn.execute("ROLLBACK")
                    raise
                await conn.execute("COMMIT")
        except _UNAVAILABLE as exc:
            self._up.set(0)
            raise Unavailable(f"database unavailable: {exc}") from exc
        except _LOCK_WAIT as exc:
            raise Unavailable(f"a lock wait timed out: {exc}") from exc
        except _UNSTORABLE as exc:
            raise InvalidArguments(f"the request holds text PostgreSQL cannot store ({exc.sqlstate})") from exc

    @contextlib.asynccontextmanager
    async def holding(self) -> AsyncIterator[None]:
        """Until the block ends, the statements of the calling asyncio task (its own, not those of
        tasks it starts) reuse one pooled connection, taken at the first: a batcher's drain pays
        one acquire and one release for a burst of batches, not one of each per batch (asyncpg's
        release alone starts a task). A statement that fails gives the connection back (the pool
        drops a broken one) and the next one takes another; a statement begun while the held
        connection is busy takes its own from the pool."""
        held = _Held(self, asyncio.current_task())
        token = _held.set(held)
        try:
            yield
        finally:
            _held.reset(token)
            held.task = None  # a statement still running under it (none should) takes its own
            await self._give_back(held)

    async def _give_back(self, held: _Held) -> None:
        """Release the held connection, if any. A failed release is logged, not raised (asyncpg
        terminates that connection): the statement's own outcome is what its caller needs."""
        conn, held.conn = held.conn, None
        if conn is None or self._pool is None:
            return
        try:
            await self._pool.release(conn)
        except asyncpg.InterfaceError:
            pass  # the pool took it back already (its server end went away)
        except Exception as exc:
            log.warning("could not give a held database connection back to the pool: %s", exc)

    @contextlib.asynccontextmanager
    async def _acquire(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection, timing the wait for it; reaching the database marks it up. Inside
        ``holding``, the held one."""
        held = _held.get()
        if held is not None and (held.db is not self or held.busy or held.task is not asyncio.current_task()):
            held = None
        if held is not None and (self.pool.is_closing() or (held.conn is not None and _gone(held.conn))):
            # The pool is closing (its close waits for every connection), or the held one was killed
            # between two statements: give it back, and the rest of this block goes through the pool.
            await self._give_back(held)
            held.task = None
            held = None
        if held is not None:
            if held.conn is None:
                started = time.perf_counter()
                held.conn = await self.pool.acquire()
                self._acquire_seconds.observe(time.perf_counter() - started)
                self._up.set(1)
            held.busy = True
            try:
                yield held.conn
            except BaseException:
                await self._give_back(held)
                raise
            finally:
                held.busy = False
            return
        started = time.perf_counter()
        async with self.pool.acquire() as conn:
            self._acquire_seconds.observe(time.perf_counter() - started)
            self._up.set(1)
            yield conn

    def pool_stats(self) -> tuple[int, int, int]:
        """(connections in use, connections open, maximum), read at scrape time."""
        if self._pool is None:
            return 0, 0, self._pool_size
        size = self._pool.get_size()
        return size - self._pool.get_idle_size(), size, self._pool_size

    def pool_usage(self) -> tuple[int, int]:
        """(connections in use, pool size) for metrics; (0, 0) when closed."""
        if self._pool is None:
            return 0, 0
        size = self._pool.get_size()
        return size - self._pool.get_idle_size(), size

    async def autovacuum_on(self) -> bool:
        """Does the server run autovacuum (which also keeps the planner's statistics)?"""
        async with self.connection() as conn:
            return bool(await conn.fetchval("SELECT current_setting('autovacuum') = 'on'"))

    async def login_may_create_in_public(self) -> bool:
        """May the login this service connects as (not a superuser, who may do anything anyway)
        create objects in schema public? PostgreSQL 14 lets every role, unless revoked."""
        async with self.connection() as conn:
            return bool(
                await conn.fetchval(
                    "SELECT has_schema_privilege(session_user, 'public', 'CREATE')"
                    " AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = session_user)"
                )
            )

    @staticmethod
    def configuration_warnings(*, autovacuum_on: bool, login_may_create_in_public: bool = False) -> list[str]:
        """What in the server's configuration (as read at start) will hurt this service."""
        warnings = []
        if login_may_create_in_public:
            # The schema's SECURITY DEFINER functions (the audit record's among them) look names
            # up in pg_catalog, then public: a function or operator created there with a closer
            # match than a built-in they call would run as their owner.
            warnings.append(
                "the service's database login may create objects in schema public (PostgreSQL 14's default): "
                "with it, the service's credentials could make the schema's SECURITY DEFINER functions run "
                "their code, and so rewrite the audit record; as a superuser or public's owner, run "
                "REVOKE CREATE ON SCHEMA public FROM PUBLIC in the service's database, and revoke any grant of "
                "CREATE on public to the service's roles (SECURITY.md, operator checklist)"
            )
        if not autovacuum_on:
            # Every task update leaves a dead row version and every audit append a new head
            # version: without vacuum the tables and their indexes only grow, and each lookup of
            # a hot row (a requestor's counter, a tenant's audit head) walks ever longer chains.
            warnings.append(
                "PostgreSQL runs with autovacuum off: the task and audit tables bloat and request latency "
                "grows the longer the service runs; turn it on (autovacuum = on) or VACUUM the database "
                "regularly (docs/operations.md, Sizing). Meanwhile the maintenance pass analyses the "
                "service's tables itself, so that the planner has statistics"
            )
        return warnings

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection in autocommit, for single statements."""
        try:
            async with self._acquire() as conn:
                yield conn
        except _UNAVAILABLE as exc:
            self._up.set(0)
            raise Unavailable(f"database unavailable: {exc}") from exc
        except _LOCK_WAIT as exc:
            raise Unavailable(f"a lock wait timed out: {exc}") from exc
        except _UNSTORABLE as exc:
            raise InvalidArguments(f"the request holds text PostgreSQL cannot store ({exc.sqlstate})") from exc

    async def fetchval(self, sql: str, *args: Any) -> Any:
        async with self.connection() as conn:
            return await conn.fetchval(sql, *args)
