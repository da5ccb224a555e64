"""Every Prometheus metric of the service: one module, one prefix (``mcp_tasks_``), bounded labels.

Labels never carry task ids or subjects. A ``tenant`` label is filled only when the operator turns
it on (``MCP_TASKS_METRICS_TENANT_LABEL``), for at most ``MCP_TASKS_METRICS_TENANT_LIMIT`` tenants
per process (the rest are ``other``); otherwise it is empty. Each process exposes its own
counters (Prometheus sums them across replicas); for several processes behind one port set
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode). ``tasks_active`` and the
queue gauges are read from the database by the sweeper, so every replica reports the same
cluster-wide value, up to one sweep old: aggregate them with max(). The pool gauges are read from
the pools at scrape time (exact). Dashboards and alerts built on these names: grafana/.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Final, Protocol, TypeVar

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from service.domain.task import Task

LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TASK_BUCKETS: Final = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400)
KNOWN_METHODS: Final = frozenset(
    {
        "initialize", "ping", "tools/list", "tools/call", "tasks/get", "tasks/result", "tasks/list", "tasks/cancel",
        "resources/list", "resources/templates/list", "resources/read", "resources/subscribe",
        "resources/unsubscribe", "prompts/list", "prompts/get", "logging/setLevel", "completion/complete",
        "server/discover", "tasks/update", "subscriptions/listen",
    }
)  # fmt: skip

build_info = Gauge(
    "mcp_tasks_build_info", "Always 1: the running version and what this process is (serve|worker)",
    ["version", "component"], multiprocess_mode="max",
)  # fmt: skip
ready = Gauge(
    "mcp_tasks_ready", "1 when the last readiness check passed (database answers, schema at head), else 0",
    ["check"], multiprocess_mode="min",
)  # fmt: skip
requests = Counter(
    "mcp_tasks_requests_total", "JSON-RPC requests by method, outcome and wire (the session's protocol version)",
    ["method", "outcome", "wire"],
)  # fmt: skip
request_errors = Counter(
    "mcp_tasks_request_errors_total", "JSON-RPC requests answered with an error, by method, JSON-RPC error code and wire",
    ["method", "code", "wire"],
)  # fmt: skip
request_seconds = Histogram(
    "mcp_tasks_request_duration_seconds",
    "Time to answer a request (whole stream for SSE), less any wait for a task to end (tasks/result)",
    ["method"], buckets=LATENCY_BUCKETS,
)  # fmt: skip
task_result_seconds = Histogram(
    "mcp_tasks_task_result_seconds", "tasks/result from request to answer, waiting for the task included",
    buckets=TASK_BUCKETS,
)  # fmt: skip
tasks_active = Gauge(
    "mcp_tasks_tasks_active", "Non-terminal tasks by status (cluster-wide, as of the last sweep)", ["status"],
    multiprocess_mode="max",
)  # fmt: skip
tasks_queued = Gauge(
    "mcp_tasks_tasks_queued", "Working tasks no runner has claimed yet, by tool (cluster-wide, as of the last sweep)",
    ["tool"], multiprocess_mode="max",
)  # fmt: skip
tasks_running = Gauge(
    "mcp_tasks_tasks_running", "Working tasks a runner holds, by tool (cluster-wide, as of the last sweep)",
    ["tool"], multiprocess_mode="max",
)  # fmt: skip
oldest_running_seconds = Gauge(
    "mcp_tasks_oldest_running_task_age_seconds", "Run time so far of the longest-running claimed task, by tool (last sweep)",
    ["tool"], multiprocess_mode="max",
)  # fmt: skip
oldest_queued_seconds = Gauge(
    "mcp_tasks_oldest_queued_task_age_seconds", "Age of the oldest unclaimed task, by tool (0 when none; last sweep)",
    ["tool"], multiprocess_mode="max",
)  # fmt: skip
tasks_without_runner = Gauge(
    "mcp_tasks_tasks_without_runner",
    "Queued tasks whose tool (at its version) no live runner has, by tool (cluster-wide; last sweep)",
    ["tool"], multiprocess_mode="max",
)  # fmt: skip
tenant_tasks_active = Gauge(
    "mcp_tasks_tenant_tasks_active", "Non-terminal tasks per tenant (only with the tenant label on; last sweep)",
    ["tenant"], multiprocess_mode="max",
)  # fmt: skip
task_start_delay = Histogram(
    "mcp_tasks_task_start_delay_seconds", "From creation to a runner starting the task", ["tool"], buckets=TASK_BUCKETS
)
task_run_seconds = Histogram("mcp_tasks_task_run_seconds", "Run time of a task's tool", ["tool"], buckets=TASK_BUCKETS)
cap_refusals = Counter("mcp_tasks_cap_refusals_total", "Task creations refused by a concurrency cap", ["scope"])
rate_limited = Counter("mcp_tasks_rate_limited_total", "Requests refused by a rate limit", ["scope"])
rate_limit_storage_errors = Counter("mcp_tasks_rate_limit_storage_errors_total", "Rate-limit storage failures")
auth_failures = Counter("mcp_tasks_auth_failures_total", "Authentication refusals by reason", ["reason"])
runner_slots = Gauge("mcp_tasks_runner_slots", "Task slots of this process's runner", multiprocess_mode="livesum")
runner_slots_in_use = Gauge(
    "mcp_tasks_runner_slots_in_use",
    "Task slots in use: tools running, and outcome writes waiting beyond the slot count",
    multiprocess_mode="livesum",
)
lease_losses = Counter(
    "mcp_tasks_lease_losses_total", "Tasks whose runner stopped, by what was done with them", ["action"]
)
fenced_writes = Counter(
    "mcp_tasks_fenced_writes_total",
    "Runner writes (finish, hand_back) refused because the task had been taken over meanwhile: its lease "
    "owner or epoch had changed, so the write changed nothing",
    ["op"],
)  # fmt: skip
for _op in ("finish", "hand_back"):  # series at 0 from the start: a first refusal shows as a rise
    fenced_writes.labels(_op)
runner_fenced = Counter(
    "mcp_tasks_runner_fenced_tasks_total",
    "Tasks whose tool this runner stopped because it could not renew their lease in time (outcome not written)",
)  # fmt: skip
runner_unconfirmed_stops = Counter(
    "mcp_tasks_runner_unconfirmed_stops_total",
    "Cancel or delete notifications for a task running here that its row did not confirm (a stale or "
    "forged notification): the task kept running",
)  # fmt: skip
sweeper_deleted = Counter("mcp_tasks_sweeper_deleted_total", "Expired tasks deleted")
http_refusals = Counter(
    "mcp_tasks_http_refusals_total",
    "Connections and requests the HTTP server refused by its limits: connections (MCP_TASKS_MAX_CONNECTIONS), "
    "requests (MCP_TASKS_MAX_CONCURRENT_REQUESTS), header_timeout (408), headers_too_large (431)",
    ["reason"],
)  # fmt: skip
for _reason in ("connections", "requests", "header_timeout", "headers_too_large"):
    http_refusals.labels(_reason)
db_pool_connections = Gauge(
    "mcp_tasks_db_pool_connections", "Database pool connections (as of the last sweep; mcp_tasks_db_pool_in_use is exact)",
    ["pool", "state"], multiprocess_mode="livesum",
)  # fmt: skip
db_up = Gauge(
    "mcp_tasks_db_up", "1 when the last use of this pool reached PostgreSQL, 0 when it found it unavailable",
    ["pool"], multiprocess_mode="min",
)  # fmt: skip
db_acquire_seconds = Histogram(
    "mcp_tasks_db_pool_acquire_seconds", "Wait for a pooled connection", ["pool"], buckets=LATENCY_BUCKETS
)
db_batch_items = Histogram(
    "mcp_tasks_db_batch_items", "Requests that shared one group-commit statement", ["batch"],
    buckets=(1, 2, 4, 8, 16, 32, 64),
)  # fmt: skip
db_batch_fallbacks = Counter(
    "mcp_tasks_db_batch_fallbacks_total", "Batches that failed as a whole and were answered item by item", ["batch"]
)
audit_write_failures = Counter("mcp_tasks_audit_write_failures_total", "Audit events that could not be written")

_tenant_label = False
_tenant_limit = 100
_tenants_seen: set[str] = set()


# The counters that carry a tenant label when the operator opts in, and none otherwise (no series
# with an always-empty label): defined here, and again by ``configure`` if the choice changes.
def _tenant_counters(with_tenant: bool) -> tuple[Counter, Counter, Counter, Counter]:
    extra = ["tenant"] if with_tenant else []
    for name in ("mcp_tasks_tasks_created", "mcp_tasks_tasks_finished", "mcp_tasks_denials", "mcp_tasks_task_seconds"):
        collector = REGISTRY._names_to_collectors.get(name)
        if collector is not None:
            REGISTRY.unregister(collector)
    created = Counter("mcp_tasks_tasks_created_total", "Tasks created", ["tool", *extra])
    finished = Counter(
        "mcp_tasks_tasks_finished_total",
        "Tasks that reached a terminal status: stored status and outcome (result, tool_error, failure, cancelled)",
        ["tool", "status", "outcome", *extra],
    )
    refused = Counter(
        "mcp_tasks_denials_total", "Requests refused for a principal, by reason (rate_limited, cap, not_found)",
        ["reason", *extra],
    )  # fmt: skip
    # Create to terminal, counted when the task ends (`mcp-tasks usage` reports the same from the
    # audit record): per tenant, with the tenant label on, for budgets and billing dashboards.
    seconds = Counter("mcp_tasks_task_seconds_total", "Seconds from create to terminal of finished tasks",
                      ["tool", *extra])  # fmt: skip
    return created, finished, refused, seconds


tasks_created, tasks_finished, denials, task_seconds = _tenant_counters(False)


def task_created(tool: str, tenant_id: str) -> None:
    (labelled(tasks_created, tool, tenant(tenant_id)) if _tenant_label else labelled(tasks_created, tool)).inc()


def task_finished(tool: str, status: str, outcome: str, tenant_id: str, seconds: float | None = None) -> None:
    labels = (tool, status, outcome, tenant(tenant_id)) if _tenant_label else (tool, status, outcome)
    labelled(tasks_finished, *labels).inc()
    if seconds is not None:
        (labelled(task_seconds, tool, tenant(tenant_id)) if _tenant_label else labelled(task_seconds, tool)).inc(
            max(0.0, seconds)
        )


def finished(task: Task) -> None:
    """A task reached a terminal status (counted where its change committed)."""
    kind = task.outcome.kind.value if task.outcome is not None else "cancelled"
    seconds = (task.last_updated_at - task.created_at).total_seconds()
    task_finished(task.tool, task.status.value, kind, task.tenant_id, seconds)


def denied(reason: str, tenant_id: str) -> None:
    (labelled(denials, reason, tenant(tenant_id)) if _tenant_label else labelled(denials, reason)).inc()


def configure(*, tenant_label: bool, tenant_limit: int = 100, version: str = "", component: str = "serve") -> None:
    """Set once at start-up from the settings."""
    global _tenant_label, _tenant_limit, tasks_created, tasks_finished, denials, task_seconds
    if tenant_label != _tenant_label:
        tasks_created, tasks_finished, denials, task_seconds = _tenant_counters(tenant_label)
    _tenant_label, _tenant_limit = tenant_label, tenant_limit
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: they double every counter and histogram
    if version:
        build_info.labels(version, component).set(1)
    _watch_pools()


def tenant_label_on() -> bool:
    return _tenant_label


def tenant(value: str) -> str:
    """The tenant label: empty unless opted in; past the cap, new tenants share ``other``."""
    if not _tenant_label:
        return ""
    if value in _tenants_seen:
        return value
    if len(_tenants_seen) >= _tenant_limit:
        return "other"
    _tenants_seen.add(value)
    return value


KNOWN_WIRES: Final = frozenset({"2025-11-25", "2025-06-18", "2025-03-26", "2026-07-28"})


_M = TypeVar("_M", Counter, Histogram)
_children: dict[tuple[object, tuple[str, ...]], object] = {}


def labelled(metric: _M, *values: str) -> _M:
    """``metric.labels(*values)``, remembered: prometheus-client takes a lock, converts and hashes
    the values on every call, and a request names three or four children. Label values are
    bounded (see above), so the table is too; it starts afresh if that ever stops being true."""
    key = (metric, values)
    found = _children.get(key)
    if found is None:
        if len(_children) > 10_000:
            _children.clear()
        found = _children[key] = metric.labels(*values)
    return found  # type: ignore[return-value]


def wire(version: str) -> str:
    """Bounded wire label: a protocol revision we speak, else 'other' ('none' before a session)."""
    return version if version in KNOWN_WIRES else "other"


def rpc_code(code: int | None) -> str:
    """Bounded error-code label: JSON-RPC's reserved range as it is, anything else 'other'."""
    if code is None:
        return "other"
    return str(code) if -32768 <= code <= -32000 else "other"


# Every request's count and latency go to prometheus-client at most this long after it ended, and
# at every scrape.
REQUEST_FLUSH_S: Final = 1.0


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class RequestMeter:
    """``requests`` and ``request_seconds`` for every request, counted on the event loop's thread.

    prometheus-client takes a lock for each value it changes, three per request (the counter, the
    histogram's sum and its bucket): about 5 % of py-spy's samples of a plain call. Here a request adds to plain
    dictionaries, and the sums go to prometheus-client at every scrape (``exposition``), at most
    ``REQUEST_FLUSH_S`` after the request (so multiprocess mode's files, which another process
    scrapes, lag by no more), and when the process exits. Nothing is lost, nothing counted twice:
    the exposition is the one per-request ``inc`` and ``observe`` would have given."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, str], int] = {}
        # Per method: one count per bucket of LATENCY_BUCKETS and +Inf (not cumulative, as
        # prometheus-client keeps them), then the sum of the latencies.
        self._latency: dict[str, list[float]] = {}
        self._flush: asyncio.TimerHandle | None = None
        self._flush_loop: asyncio.AbstractEventLoop | None = None

    def record(self, method: str, outcome: str, wire: str, seconds: float) -> None:
        key = (method, outcome, wire)
        counts = self._counts
        counts[key] = counts.get(key, 0) + 1
        row = self._latency.get(method)
        if row is None:
            row = self._latency[method] = [0.0] * (len(LATENCY_BUCKETS) + 2)
        row[bisect_left(LATENCY_BUCKETS, seconds)] += 1  # the first bound >= seconds (le)
        row[-1] += seconds
        if self._flush is None or self._flush_loop is not _running_loop():
            # (A timer of a loop since closed, as a test's, would never fire: set one on this loop.)
            self._schedule()

    def _schedule(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        loop = _running_loop()
        if loop is None:  # no event loop here: hand it over at once
            self.flush()
            return
        self._flush = loop.call_later(REQUEST_FLUSH_S, self.flush)
        self._flush_loop = loop

    def flush(self) -> None:
        """Hand what was counted since the last flush to prometheus-client."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        counts, self._counts = self._counts, {}
        latency, self._latency = self._latency, {}
        for (method, outcome, wire), n in counts.items():
            labelled(requests, method, outcome, wire).inc(n)
        for method, row in latency.items():
            child = labelled(request_seconds, method)
            # Histogram has no bulk observe: its per-bucket values and sum, as observe changes them.
            buckets = child._buckets
            for i, seen in enumerate(row[:-1]):
                if seen:
                    buckets[i].inc(seen)
            child._sum.inc(row[-1])


request_meter: Final = RequestMeter()


_waits: ContextVar[list[float] | None] = ContextVar("mcp_tasks_waits", default=None)


def track_waits() -> list[float]:
    """Start collecting this request's waits for tasks (see ``waiting_for_task``)."""
    acc: list[float] = []
    _waits.set(acc)
    return acc


@contextlib.contextmanager
def waiting_for_task() -> Iterator[None]:
    """Wrap a wait for a task to end (tasks/result) so the request's latency leaves it out."""
    started = time.perf_counter()
    try:
        yield
    finally:
        acc = _waits.get()
        if acc is not None:
            acc.append(time.perf_counter() - started)


class PoolStats(Protocol):
    def pool_stats(self) -> tuple[int, int, int]:
        """(connections in use, connections open, maximum)."""
        ...


_pools: dict[int, tuple[str, PoolStats]] = {}


def watch_pool(name: str, pool: PoolStats) -> None:
    """Report this pool's exact use at every scrape, until ``unwatch_pool``."""
    _pools[id(pool)] = (name, pool)


def unwatch_pool(pool: PoolStats) -> None:
    _pools.pop(id(pool), None)


class _PoolCollector(Collector):
    def collect(self) -> Iterable[GaugeMetricFamily]:
        in_use = GaugeMetricFamily("mcp_tasks_db_pool_in_use", "Pooled connections in use now", labels=["pool"])
        size = GaugeMetricFamily("mcp_tasks_db_pool_size", "Pooled connections open now", labels=["pool"])
        cap = GaugeMetricFamily("mcp_tasks_db_pool_max", "Most connections the pool may open", labels=["pool"])
        totals: dict[str, list[int]] = {}
        for name, pool in list(_pools.values()):
            row = totals.setdefault(name, [0, 0, 0])
            for i, v in enumerate(pool.pool_stats()):
                row[i] += v
        for name, (used, opened, most) in sorted(totals.items()):
            in_use.add_metric([name], used)
            size.add_metric([name], opened)
            cap.add_metric([name], most)
        return [in_use, size, cap]


_pool_collector: _PoolCollector | None = None


def _watch_pools() -> None:
    global _pool_collector
    if _pool_collector is None:
        _pool_collector = _PoolCollector()
        REGISTRY.register(_pool_collector)


def method(value: str) -> str:
    """Bounded method label: unknown methods are 'other'."""
    return value if value in KNOWN_METHODS else "other"


def process_exiting() -> None:
    """On the way out: the requests counted since the last hand-over go to prometheus-client, and in
    multiprocess mode this process's live gauges (runner slots, pool use) are dropped."""
    request_meter.flush()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


def exposition() -> bytes:
    """The text exposition of this process, or of all processes in multiprocess mode."""
    request_meter.flush()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
    return generate_latest()
