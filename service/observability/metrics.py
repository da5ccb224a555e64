"""Every Prometheus metric of the service: one module, one prefix (``mcp_tasks_``), bounded labels.

Labels never carry task ids or subjects. A ``tenant`` label is filled only when the operator turns
it on (``MCP_TASKS_METRICS_TENANT_LABEL``); otherwise it is empty. Each process exposes its own
counters (Prometheus sums them across replicas); for several processes behind one port set
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode). ``tasks_active`` is read
from the database, so every replica reports the same cluster-wide value: aggregate it with max().
"""

from __future__ import annotations

import os
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TASK_BUCKETS: Final = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400)
KNOWN_METHODS: Final = frozenset(
    {
        "initialize", "ping", "tools/list", "tools/call", "tasks/get", "tasks/result", "tasks/list", "tasks/cancel",
        "resources/list", "resources/templates/list", "resources/read", "resources/subscribe",
        "resources/unsubscribe", "prompts/list", "prompts/get", "logging/setLevel", "completion/complete",
    }
)  # fmt: skip

requests = Counter("mcp_tasks_requests_total", "JSON-RPC requests by method and outcome", ["method", "outcome"])
request_seconds = Histogram(
    "mcp_tasks_request_duration_seconds", "Time to answer a request (whole stream for SSE)", ["method"],
    buckets=LATENCY_BUCKETS,
)  # fmt: skip
tasks_created = Counter("mcp_tasks_tasks_created_total", "Tasks created", ["tool", "tenant"])
tasks_finished = Counter(
    "mcp_tasks_tasks_finished_total",
    "Tasks that reached a terminal status: stored status and outcome (result, tool_error, failure, cancelled)",
    ["tool", "status", "outcome", "tenant"],
)
tasks_active = Gauge(
    "mcp_tasks_tasks_active", "Non-terminal tasks by status (cluster-wide)", ["status"], multiprocess_mode="max"
)
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
    "mcp_tasks_runner_slots_in_use", "Task slots executing a tool now", multiprocess_mode="livesum"
)
lease_losses = Counter(
    "mcp_tasks_lease_losses_total", "Tasks whose runner stopped, by what was done with them", ["action"]
)
sweeper_deleted = Counter("mcp_tasks_sweeper_deleted_total", "Expired tasks deleted")
db_pool_connections = Gauge(
    "mcp_tasks_db_pool_connections", "Database pool connections", ["pool", "state"], multiprocess_mode="livesum"
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


def configure(*, tenant_label: bool) -> None:
    """Set once at start-up from the settings."""
    global _tenant_label
    _tenant_label = tenant_label


def tenant(value: str) -> str:
    return value if _tenant_label else ""


def method(value: str) -> str:
    """Bounded method label: unknown methods are 'other'."""
    return value if value in KNOWN_METHODS else "other"


def process_exiting() -> None:
    """In multiprocess mode, drop this process's live gauges (runner slots, pool use) on the way out."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


def exposition() -> bytes:
    """The text exposition of this process, or of all processes in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
    return generate_latest()
