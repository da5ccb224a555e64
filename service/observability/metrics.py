"""Every Prometheus metric of the service: one module, one prefix (``mcp_tasks_``), bounded labels.

Labels never carry task ids or subjects. A ``tenant`` label is filled only when the operator turns
it on (``MCP_TASKS_METRICS_TENANT_LABEL``), for at most ``MCP_TASKS_METRICS_TENANT_LIMIT`` tenants
per process (the rest are ``other``); otherwise it is empty. Each process exposes its own
counters (Prometheus sums them across replicas); for several processes behind one port set
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode). ``tasks_active`` and the
queue gauges are read from the database by the sweeper, so every replica reports the same
cluster-wide value, up to one sweep old: aggregate them with max(). The pool gauges are read from
the pools at scrape time (exact; their collector is in pool_metrics). Dashboards and alerts built on
these names: grafana/.
"""

from __future__ import annotations

import os
from typing import Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client.openmetrics import exposition as openmetrics

from service.domain.task import Task

# The helpers callers reach as ``metrics.<name>``, kept where they are defined.
from service.observability.metric_labels import labelled as labelled
from service.observability.metric_labels import method as method
from service.observability.metric_labels import rpc_code as rpc_code
from service.observability.metric_labels import wire as wire
from service.observability.pool_metrics import register_pool_collector
from service.observability.pool_metrics import unwatch_pool as unwatch_pool
from service.observability.pool_metrics import watch_pool as watch_pool
from service.observability.request_meter import RequestMeter
from service.observability.request_meter import track_waits as track_waits
from service.observability.request_meter import waiting_for_task as waiting_for_task

LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TASK_BUCKETS: Final = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400)

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
tenant_storage_bytes = Gauge(
    "mcp_tasks_tenant_storage_bytes",
    "Bytes a tenant's tasks keep, as its storage quota counts them (only with the tenant label on; last sweep)",
    ["tenant"], multiprocess_mode="max",
)  # fmt: skip
storage_bytes = Gauge(
    "mcp_tasks_storage_bytes",
    "Bytes every tenant's tasks keep (arguments and results), as the storage quotas count them (cluster-wide; last sweep)",
    multiprocess_mode="max",
)  # fmt: skip
task_start_delay = Histogram(
    "mcp_tasks_task_start_delay_seconds", "From creation to a runner starting the task", ["tool"], buckets=TASK_BUCKETS
)
task_run_seconds = Histogram("mcp_tasks_task_run_seconds", "Run time of a task's tool", ["tool"], buckets=TASK_BUCKETS)
tool_runtime_limit_seconds = Gauge(
    "mcp_tasks_tool_runtime_limit_seconds",
    "The runtime limit of each tool's tasks, counted from their first start (the tool's own, else and at most "
    "MCP_TASKS_MAX_RUNTIME_S), as this runner enforces it",
    ["tool"], multiprocess_mode="max",
)  # fmt: skip
task_limit_failures = Counter(
    "mcp_tasks_task_limit_failures_total",
    "Tasks failed by a limit: runtime (the tool ran past its runtime limit) or input (no answer to a question "
    "within MCP_TASKS_INPUT_TIMEOUT_S)",
    ["tool", "limit"],
)  # fmt: skip
# Upstream MCP servers (service.upstream): labelled by the upstream's name from the operator's file.
upstream_up = Gauge(
    "mcp_tasks_upstream_up", "1 while this process's control session with the upstream is open, else 0",
    ["upstream"], multiprocess_mode="min",
)  # fmt: skip
upstream_calls = Counter(
    "mcp_tasks_upstream_calls_total",
    "Calls of upstream tools by outcome: ok, tool_error (the upstream answered isError), error (it failed the "
    "call: unreachable, closed, silent, timed out, garbage, an error answer), refused (circuit open or down), "
    "cancelled (by our side)",
    ["upstream", "outcome"],
)  # fmt: skip
upstream_call_seconds = Histogram(
    "mcp_tasks_upstream_call_seconds", "Time of a call to an upstream tool, session set-up included", ["upstream"],
    buckets=TASK_BUCKETS,
)  # fmt: skip
upstream_in_flight = Gauge(
    "mcp_tasks_upstream_calls_in_flight", "Calls to the upstream in flight from this process", ["upstream"],
    multiprocess_mode="livesum",
)  # fmt: skip
upstream_circuit_open = Gauge(
    "mcp_tasks_upstream_circuit_open", "1 while this process's circuit breaker refuses calls to the upstream",
    ["upstream"], multiprocess_mode="max",
)  # fmt: skip
UPSTREAM_OUTCOMES: Final = ("ok", "tool_error", "error", "refused", "cancelled")


def upstream_configured(name: str) -> None:
    """Every series of an upstream at zero from the start, so that rates and alerts see it."""
    upstream_up.labels(name).set(0)
    upstream_circuit_open.labels(name).set(0)
    upstream_in_flight.labels(name)
    for outcome in UPSTREAM_OUTCOMES:
        upstream_calls.labels(name, outcome)


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
runner_waiting = Gauge(
    "mcp_tasks_runner_waiting",
    "Runs waiting for their client's answer with their slot given back (issue 42: waiting is not running)",
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
    register_pool_collector()


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


request_meter: Final = RequestMeter(requests, request_seconds, LATENCY_BUCKETS)


def process_exiting() -> None:
    """On the way out: the requests counted since the last hand-over go to prometheus-client, and in
    multiprocess mode this process's live gauges (runner slots, pool use) are dropped."""
    request_meter.flush()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


def exposition(accept: str = "") -> tuple[bytes, str]:
    """The exposition of this process, or of all processes in multiprocess mode, and its content
    type: OpenMetrics when the scraper accepts it (the format that carries exemplars: latency
    observations' trace ids while tracing is on), else Prometheus' text format."""
    request_meter.flush()
    registry: CollectorRegistry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    if "application/openmetrics-text" in accept:
        return openmetrics.generate_latest(registry), openmetrics.CONTENT_TYPE_LATEST  # type: ignore[no-untyped-call]
    return generate_latest(registry), CONTENT_TYPE_LATEST
