"""The process core shared by ``serve`` and ``worker``: database, events, tools, services, runners."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from service.config import Settings
from service.observability import metrics
from service.runtime.engine import Engine
from service.runtime.executor import Executor
from service.runtime.maintenance import Maintenance
from service.runtime.runner import Runner
from service.runtime.runs import RunLimits
from service.store import migrate
from service.store.db import APP_ROLE, RUNNER_ROLE, Database
from service.store.embedded import open_embedded
from service.store.events import EventHub, ToolsChanged
from service.store.tasks import service_key
from service.store.upstreams import UpstreamStates
from service.store.usage import PlainCallTally
from service.tasks.cursor import CursorCodec
from service.tasks.policy import TaskPolicy
from service.tasks.request_state import RequestStateCodec
from service.tasks.service import TaskService
from service.tasks.sessions import SessionService
from service.tasks.signals import Signals
from service.tools.registry import Registry

if TYPE_CHECKING:
    from service.upstream.config import UpstreamConfig
    from service.upstream.manager import Upstreams

log = logging.getLogger(__name__)

# CPython's cyclic collector, tuned for a server process (tune_gc). The defaults (700, 10, 10)
# collect the young generation every 700 net container allocations: a few requests. With many
# tasks in flight the process holds hundreds of thousands of objects, and the older generations'
# collections that follow scan them all: measured with 6,400 extension tasks running, 143-150 µs of
# collection per tasks/get (in process), 18 µs with these (measured in b80616e).
# Cyclic garbage still goes: the young generation every 50,000 allocations (well under a MiB),
# the oldest after 10 million at most (seconds at full load), and reference counting frees the rest
# at once as always.
GC_THRESHOLDS: Final = (50_000, 20, 10)


def tune_gc() -> None:
    """For `serve` and `worker`, once the process has started up: what exists now (modules,
    settings, the app) lives as long as the process, so it leaves the collector's generations
    (gc.freeze); later collections are rarer (GC_THRESHOLDS)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


@dataclass
class Core:
    settings: Settings
    dsn: str
    db: Database
    runner_db: Database
    hub: EventHub
    registry: Registry
    tasks: TaskService
    sessions: SessionService
    signals: Signals
    runner: Runner | None
    maintenance: Maintenance
    stop_database: Callable[[], None] | None = None
    drain_deadline: float | None = None
    upstreams: Upstreams | None = None

    def begin_drain(self, grace_s: float) -> float:
        """A shutdown began: readiness goes false, runners claim nothing more; returns the deadline
        (loop time) by which running tasks should have finished. Idempotent: the first call counts."""
        if self.drain_deadline is None:
            self.drain_deadline = asyncio.get_running_loop().time() + grace_s
            if self.runner is not None:
                self.runner.drain()
        return self.drain_deadline

    async def close(self) -> None:
        # Maintenance first: a pass between the runner's hand-back and its withdrawal from the
        # runners table would relabel the tasks it just re-queued as having no runner at all.
        await self.maintenance.stop()
        if self.runner is not None:
            deadline = self.begin_drain(self.settings.shutdown_grace_s)
            await self.runner.stop(deadline)
        if self.upstreams is not None:
            await self.upstreams.stop()
        await self.hub.stop()
        await self.runner_db.close()
        await self.db.close()
        if self.stop_database is not None:
            await asyncio.to_thread(self.stop_database)
        metrics.process_exiting()


def request_session_settings(settings: Settings) -> dict[str, str]:
    """Session defaults of the request pool: bounded lock waits (a held create lock answers 503
    instead of stalling every tenant's batch), and how often the schema's audit_append records a
    requestor's repeated retrieval of a finished task (issue 14, findings 3 and 7)."""
    return {
        "lock_timeout": f"{settings.db_lock_timeout_ms}ms",
        "mcp_tasks.audit_retrieve_interval_s": str(settings.audit_retrieve_interval_s),
    }


async def check_schema(dsn: str) -> None:
    """Fail fast, saying what to do, when the database is unreachable or not at this version's schema."""
    head = migrate.head_revision()
    try:
        current = await migrate.current_revision(dsn)
    except Exception as exc:
        raise RuntimeError(f"cannot connect to MCP_TASKS_DATABASE_URL ({type(exc).__name__}: {exc})") from exc
    if current is not None and migrate.before_baseline(current):
        raise RuntimeError(
            f"the database schema is at {current}, made by a development build before release 0.1.0: recreate the "
            "database (its migrations were squashed into one baseline)"
        )
    if not migrate.schema_fits(current):
        raise RuntimeError(
            f"the database schema is at {current or 'nothing'}, this version needs {head}: run `mcp-tasks migrate`"
        )
    if current != head:
        log.warning("the database schema (%s) is newer than this version's (%s): running on it", current, head)


async def resolve_database(settings: Settings) -> tuple[str, Callable[[], None] | None]:
    """The configured database (checked), or the embedded one (started and migrated here) and how
    to stop it."""
    if settings.database_url:
        await check_schema(settings.database_url)
        return settings.database_url, None
    dsn, stop = await asyncio.to_thread(open_embedded, settings.data_dir)
    await migrate.upgrade_async(dsn)
    return dsn, stop


def load_upstreams(settings: Settings, registry: Registry) -> list[UpstreamConfig]:
    """The upstreams file, checked (an UpstreamConfigError names the upstream and the key)."""
    if not settings.upstreams_file:
        return []
    from service.upstream import config

    upstreams = config.load(settings.upstreams_file)
    config.check_no_clash(upstreams, registry.tools)
    return upstreams


class UpstreamBoard:
    """Where this process records what it sees of its upstreams (``mcp-tasks upstreams``)."""

    def __init__(self, db: Database) -> None:
        self.states = UpstreamStates(db)
        self.owner = f"{socket.gethostname()}:{os.getpid()}"

    async def publish(self, states: list[dict[str, Any]], live_ms: int) -> None:
        await self.states.publish(self.owner, states, live_ms)

    async def withdraw(self) -> None:
        await self.states.withdraw(self.owner)


async def start_upstreams(
    settings: Settings, registry: Registry, configs: list[UpstreamConfig], runner_db: Database
) -> Upstreams | None:
    """Follow the upstreams (the MCP SDK is imported only when there are some)."""
    if not configs:
        return None
    from service.upstream.manager import Upstreams

    upstreams = Upstreams(
        configs, registry, grace_s=settings.upstream_down_grace_s, max_result_bytes=settings.max_result_bytes,
        board=UpstreamBoard(runner_db),
    )  # fmt: skip
    await upstreams.start()
    return upstreams


async def open_core(settings: Settings, *, run_tasks: bool = True) -> Core:
    registry = Registry.load(settings.tool_packs, max_runtime_s=settings.max_runtime_s)
    upstream_configs = load_upstreams(settings, registry)
    registry.may_change = bool(upstream_configs)
    dsn, stop_database = await resolve_database(settings)
    db = Database(dsn, pool_size=settings.db_pool_size, role=APP_ROLE, settings=request_session_settings(settings))
    await db.open()
    autovacuum_on = await db.autovacuum_on()  # read once: it decides a warning and the pass's analyses
    may_create = await db.login_may_create_in_public()
    for warning in db.configuration_warnings(autovacuum_on=autovacuum_on, login_may_create_in_public=may_create):
        log.warning(warning)
    runner_db = Database(
        dsn, pool_size=max(2, min(settings.db_pool_size, settings.runner_concurrency)), role=RUNNER_ROLE
    )
    await runner_db.open()
    hub = EventHub(db)
    await hub.start()
    # Upstreams' tools come and go: each change is told to this process's GET streams and listens.
    registry.listeners.append(lambda: hub.dispatch(ToolsChanged("")))
    cursor_key = await service_key(db, "tasks-list-cursor")
    policy = TaskPolicy(
        default_ttl_ms=settings.effective_default_ttl_ms,
        min_ttl_ms=settings.min_ttl_ms,
        max_ttl_ms=settings.effective_max_ttl_ms,
        poll_interval_ms=settings.poll_interval_ms,
        max_active_per_requestor=settings.max_active_tasks_per_requestor,
        max_active_per_tenant=settings.max_active_tasks_per_tenant,
        tenant_storage_quota_bytes=settings.tenant_storage_quota_bytes or None,
    )
    poll_s = settings.poll_interval_ms / 1000
    state_key = await service_key(db, "mrtr-request-state")
    upstreams = await start_upstreams(settings, registry, upstream_configs, runner_db)
    executor = Executor(registry)
    runner = None
    if run_tasks and settings.runner_concurrency > 0:
        runner = Runner(
            runner_db,
            hub,
            executor,
            concurrency=settings.runner_concurrency,
            lease_ms=settings.lease_ms,
            poll_s=poll_s,
            tenant_share=settings.effective_tenant_share,
            limits=RunLimits(max_runtime_s=settings.max_runtime_s, input_timeout_s=settings.input_timeout_s),
        )
        await runner.start()
    engine = Engine(executor, runner)
    plain_calls = PlainCallTally()
    tasks = TaskService(db, hub, engine, policy, CursorCodec(cursor_key), RequestStateCodec(state_key), plain_calls)
    maintenance = Maintenance(
        runner_db,
        registry,
        interval_s=settings.sweep_interval_ms / 1000,
        session_idle_ms=settings.session_idle_ms,
        pools={"app": db, "runner": runner_db},
        audit_retention_days=settings.audit_retention_days,
        analyze=not autovacuum_on,
        plain_calls=plain_calls,
    )
    await maintenance.start()
    return Core(
        settings,
        dsn,
        db,
        runner_db,
        hub,
        registry,
        tasks,
        SessionService(db, hub, max_per_principal=settings.max_sessions_per_principal),
        Signals(hub),
        runner,
        maintenance,
        stop_database,
        upstreams=upstreams,
    )
