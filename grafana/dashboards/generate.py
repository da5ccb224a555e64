"""Grafana dashboards of mcp-task-service, as code (grafana-foundation-sdk); writes the JSON beside this file.

    python grafana/dashboards/generate.py          # rewrite mcp-tasks-*.json
    python grafana/dashboards/generate.py --check  # exit 1 if a committed file differs from the code

Every query uses only metrics of service/observability/metrics.py (and the recording rules of
grafana/alerts/mcp-tasks.rules.yaml); tests/ops/test_live_prometheus.py evaluates each of them
against a real Prometheus scraping a real `mcp-tasks serve` and worker.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableHide,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

HERE = Path(__file__).resolve().parent
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | table
    width: int = 8


def _panel(spec: PanelSpec, panel_id: int) -> timeseries.Panel | stat.Panel | table.Panel:
    builder: timeseries.Panel | stat.Panel | table.Panel
    if spec.kind == "stat":
        builder = (
            stat.Panel()
            .graph_mode(BigValueGraphMode.NONE)
            .color_mode(BigValueColorMode.VALUE)
            .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        )
    elif spec.kind == "table":
        builder = table.Panel().show_header(True)
    else:
        builder = (
            timeseries.Panel()
            .fill_opacity(10)
            .line_width(1)
            .legend(
                common.VizLegendOptions()
                .display_mode(LegendDisplayMode.LIST)
                .placement(LegendPlacement.BOTTOM)
                .show_legend(True)
                .calcs([])
            )
            .tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
        )
    builder = builder.id(panel_id).title(spec.title).description(spec.description).datasource(DS).unit(spec.unit)
    builder = builder.height(8).span(spec.width)
    for i, q in enumerate(spec.queries):
        target = prometheus.Dataquery().expr(q.expr).legend_format(q.legend or "__auto").ref_id(chr(ord("A") + i))
        if spec.kind in ("stat", "table"):
            target = target.instant()
        builder = builder.with_target(target)
    return builder


def _quantiles(metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> tuple[Query, ...]:
    group = f"le, {by}" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{RATE}])))",
            f"{prefix}p{round(q * 100)}",
        )
        for q in qs
    )


# --- the overview an on-call SRE opens first ----------------------------------------------------

OVERVIEW: dict[str, list[PanelSpec]] = {
    "Requests": [
        PanelSpec(
            "Request rate by method",
            "JSON-RPC requests per second by method and outcome (ok, error, internal_error).",
            (Query(f"sum by (method, outcome) (rate(mcp_tasks_requests_total[{RATE}]))", "{{method}} {{outcome}}"),),
            "reqps",
            width=6,
        ),
        PanelSpec(
            "Errors by method and JSON-RPC code",
            "-32602 not found / invalid params, -32000 cap, -32029 rate limit are the client's; "
            "-32603 internal and -32001 / -31001 unavailable are ours (they burn the SLO).",
            (Query(f"sum by (method, code) (rate(mcp_tasks_request_errors_total[{RATE}]))", "{{method}} {{code}}"),),
            "reqps",
            width=6,
        ),
        PanelSpec(
            "Requests and errors by wire",
            "By the session's protocol revision (2025-11-25 Tasks, older plain revisions; none before a session).",
            (
                Query(f"sum by (wire) (rate(mcp_tasks_requests_total[{RATE}]))", "{{wire}} all"),
                Query(f"sum by (wire) (rate(mcp_tasks_request_errors_total[{RATE}]))", "{{wire}} errors"),
            ),
            "reqps",
            width=6,
        ),
        PanelSpec(
            "Server-fault ratio (SLO 99.9 %)",
            "Share of requests answered -32603/-32001/-31001 (recording rules of grafana/alerts); the budget is 0.1 %.",
            (
                Query("mcp_tasks:request_faults:ratio_rate5m", "5m"),
                Query("mcp_tasks:request_faults:ratio_rate1h", "1h"),
            ),
            "percentunit",
            width=6,
        ),
        PanelSpec(
            "Latency by method (p50, p95, p99)",
            "Time to answer, the whole stream for SSE, less the wait for a task to end (tasks/result).",
            _quantiles("mcp_tasks_request_duration_seconds", "method", (0.5, 0.99)),
            "s",
            width=12,
        ),
        PanelSpec(
            "tasks/result, wait included (p50, p95)",
            "tasks/result from request to answer including the wait for the task: what a client experiences.",
            _quantiles("mcp_tasks_task_result_seconds", qs=(0.5, 0.95)),
            "s",
            width=12,
        ),
    ],
    "Tasks": [
        PanelSpec(
            "Tasks created by tool",
            "Tasks created per second.",
            (Query(f"sum by (tool) (rate(mcp_tasks_tasks_created_total[{RATE}]))", "{{tool}}"),),
            "ops",
        ),
        PanelSpec(
            "Tasks finished by outcome",
            "Terminal tasks per second by outcome (result, tool_error, error, cancelled) and stored status.",
            (
                Query(
                    f"sum by (outcome, status) (rate(mcp_tasks_tasks_finished_total[{RATE}]))",
                    "{{outcome}} {{status}}",
                ),
            ),
            "ops",
        ),
        PanelSpec(
            "Active tasks (working, waiting for input)",
            "Non-terminal tasks, cluster-wide, as of the last sweep (every replica reports the same: max).",
            (Query("max by (status) (mcp_tasks_tasks_active)", "{{status}}"),),
        ),
        PanelSpec(
            "Queued vs running by tool",
            "Working tasks no runner holds yet (queued) and those a runner holds (running), as of the last sweep.",
            (
                Query("max by (tool) (mcp_tasks_tasks_queued)", "queued {{tool}}"),
                Query("max by (tool) (mcp_tasks_tasks_running)", "running {{tool}}"),
            ),
        ),
        PanelSpec(
            "Oldest queued task by tool",
            "How long the oldest unclaimed task has waited for a runner.",
            (Query("max by (tool) (mcp_tasks_oldest_queued_task_age_seconds)", "{{tool}}"),),
            "s",
        ),
        PanelSpec(
            "Oldest running task by tool, against its runtime limit",
            "How long the oldest claimed task of each tool has run (from its first start, takeovers included), "
            "and the tool's runtime limit, past which it is cancelled and fails (alert McpTasksNearRuntimeLimit "
            "at 80 %). Limits hit: runtime (the tool ran too long), input (no answer in time).",
            (
                Query("max by (tool) (mcp_tasks_oldest_running_task_age_seconds)", "running {{tool}}"),
                Query("max by (tool) (mcp_tasks_tool_runtime_limit_seconds)", "limit {{tool}}"),
            ),
            "s",
        ),
        PanelSpec(
            "Tasks failed by a limit",
            "Tasks failed because their tool ran past its runtime limit, or no answer to a question came within "
            "MCP_TASKS_INPUT_TIMEOUT_S.",
            (
                Query(
                    f"sum by (tool, limit) (increase(mcp_tasks_task_limit_failures_total[{RATE}]))",
                    "{{limit}} {{tool}}",
                ),
            ),
        ),
        PanelSpec(
            "Queued tasks no live runner can run, by tool",
            "Queued tasks whose tool (at its version) no live runner loads: they wait, told so in their "
            "statusMessage (alert McpTasksToolWithoutRunner). Start a worker with the tool's pack.",
            (Query("max by (tool) (mcp_tasks_tasks_without_runner)", "{{tool}}"),),
        ),
        PanelSpec(
            "Time to first claim (p50, p95, p99)",
            "From creation to a runner starting the task.",
            _quantiles("mcp_tasks_task_start_delay_seconds"),
            "s",
        ),
        PanelSpec(
            "Run time by tool (p50, p95)",
            "How long tools run.",
            _quantiles("mcp_tasks_task_run_seconds", "tool", (0.5, 0.95)),
            "s",
            width=12,
        ),
        PanelSpec(
            "Lease losses and requeues (reaper)",
            "Tasks whose runner stopped: failed with a clear message, or requeued when the tool is safe to re-run.",
            (Query(f"sum by (action) (increase(mcp_tasks_lease_losses_total[{RATE}]))", "{{action}}"),),
            width=6,
        ),
        PanelSpec(
            "Expired tasks deleted (sweeper)",
            "Tasks past their TTL removed per second.",
            (Query(f"sum(rate(mcp_tasks_sweeper_deleted_total[{RATE}]))", "deleted"),),
            "ops",
            width=6,
        ),
    ],
    "Capacity": [
        PanelSpec(
            "Runner utilisation",
            "Runner slots executing a tool, of all slots (serve and workers); and runs waiting for their "
            "client's answer, which hold no slot meanwhile, as a share of the slots.",
            (
                Query("sum(mcp_tasks_runner_slots_in_use) / clamp_min(sum(mcp_tasks_runner_slots), 1)", "all"),
                Query("sum(mcp_tasks_runner_waiting) / clamp_min(sum(mcp_tasks_runner_slots), 1)", "waiting for input"),
                Query(
                    "sum by (instance) (mcp_tasks_runner_slots_in_use) / clamp_min(sum by (instance) (mcp_tasks_runner_slots), 1)",
                    "{{instance}}",
                ),
            ),
            "percentunit",
        ),
        PanelSpec(
            "Fencing: runs stopped, writes refused",
            "Tools a runner stopped because it could not renew their leases in time (database out of reach), "
            "and runner writes refused because the task had been taken over meanwhile (docs/decisions.md, Fencing).",
            (
                Query(f"sum(increase(mcp_tasks_runner_fenced_tasks_total[{RATE}]))", "runs stopped"),
                Query(f"sum by (op) (increase(mcp_tasks_fenced_writes_total[{RATE}]))", "{{op}} refused"),
            ),
        ),
        PanelSpec(
            "Database pool: in use of maximum",
            "Connections in use and the most each pool may open, read from the pools at scrape time.",
            (
                Query("sum by (pool) (mcp_tasks_db_pool_in_use)", "{{pool}} in use"),
                Query("sum by (pool) (mcp_tasks_db_pool_size)", "{{pool}} open"),
                Query("sum by (pool) (mcp_tasks_db_pool_max)", "{{pool}} max"),
            ),
        ),
        PanelSpec(
            "Database pool acquire wait (p95, p99)",
            "Waiting for a pooled connection; rising with a full pool means the pool is too small.",
            _quantiles("mcp_tasks_db_pool_acquire_seconds", "pool", (0.95, 0.99)),
            "s",
        ),
        PanelSpec(
            "Group-commit batch size (p50, p95)",
            "Requests that shared one statement, by batch.",
            _quantiles("mcp_tasks_db_batch_items", "batch", (0.5, 0.95)),
        ),
        PanelSpec(
            "Batches answered item by item",
            "A batch failed as a whole and was retried one request at a time.",
            (Query(f"sum by (batch) (rate(mcp_tasks_db_batch_fallbacks_total[{RATE}]))", "{{batch}}"),),
            "ops",
        ),
        PanelSpec(
            "Database reachable",
            "1 when the last use of each pool reached PostgreSQL (worst instance).",
            (Query("min by (pool) (mcp_tasks_db_up)", "{{pool}}"),),
            kind="stat",
        ),
    ],
    "Guards and security": [
        PanelSpec(
            "Rate-limit denials by scope",
            "Requests refused with 429 (-32029).",
            (Query(f"sum by (scope) (rate(mcp_tasks_rate_limited_total[{RATE}]))", "{{scope}}"),),
            "reqps",
        ),
        PanelSpec(
            "Cap refusals by scope",
            "Task creations refused by the per-requestor or per-tenant cap on active tasks.",
            (Query(f"sum by (scope) (rate(mcp_tasks_cap_refusals_total[{RATE}]))", "{{scope}}"),),
            "ops",
        ),
        PanelSpec(
            "Authentication failures by reason",
            "no_token is the first step of OAuth discovery; issuer_unavailable means the JWKS cannot be fetched.",
            (Query(f"sum by (reason) (rate(mcp_tasks_auth_failures_total[{RATE}]))", "{{reason}}"),),
            "reqps",
        ),
        PanelSpec(
            "HTTP refusals by reason",
            "The HTTP server's own limits: connections and requests beyond MCP_TASKS_MAX_CONNECTIONS and "
            "MCP_TASKS_MAX_CONCURRENT_REQUESTS (503), header_timeout (408), headers_too_large (431).",
            (Query(f"sum by (reason) (rate(mcp_tasks_http_refusals_total[{RATE}]))", "{{reason}}"),),
            "reqps",
        ),
        PanelSpec(
            "Audit write failures",
            "Audit events that could not be written (accountability is broken while this is above 0).",
            (Query(f"sum(increase(mcp_tasks_audit_write_failures_total[{RATE}]))", "failures"),),
            width=6,
        ),
        PanelSpec(
            "Rate-limit storage errors",
            "Rate-limit storage (Redis) failures: limits fail open meanwhile.",
            (Query(f"sum(rate(mcp_tasks_rate_limit_storage_errors_total[{RATE}]))", "errors"),),
            "ops",
            width=6,
        ),
    ],
    "Upstream MCP servers": [
        PanelSpec(
            "Upstreams up",
            "1 while at least one process has a session with the upstream (MCP_TASKS_UPSTREAMS_FILE); "
            "`mcp-tasks upstreams` shows each process's view and last error.",
            (Query("max by (upstream) (mcp_tasks_upstream_up)", "{{upstream}}"),),
            kind="stat",
            width=6,
        ),
        PanelSpec(
            "Upstream calls by outcome",
            "ok; tool_error (the upstream answered isError); error (unreachable, closed, silent past "
            "idle_timeout_s, past timeout_s, garbage, an error answer); refused (circuit open or down); cancelled.",
            (
                Query(
                    f"sum by (upstream, outcome) (rate(mcp_tasks_upstream_calls_total[{RATE}]))",
                    "{{upstream}} {{outcome}}",
                ),
            ),
            "ops",
            width=6,
        ),
        PanelSpec(
            "Upstream call time",
            "A call to the upstream, its session's set-up included (p50, p95).",
            _quantiles("mcp_tasks_upstream_call_seconds", "upstream", (0.5, 0.95)),
            "s",
            width=6,
        ),
        PanelSpec(
            "Upstream calls in flight and open circuits",
            "Calls in flight (at most max_concurrency per process), and processes whose breaker refuses calls.",
            (
                Query("sum by (upstream) (mcp_tasks_upstream_calls_in_flight)", "{{upstream}} in flight"),
                Query("sum by (upstream) (mcp_tasks_upstream_circuit_open)", "{{upstream}} circuits open"),
            ),
            width=6,
        ),
    ],
    "Processes": [
        PanelSpec(
            "Versions running",
            "Processes by version and component (serve, worker).",
            (Query("count by (version, component) (mcp_tasks_build_info)", "{{component}} {{version}}"),),
            kind="table",
            width=12,
        ),
        PanelSpec(
            "Ready",
            "1 when the last /readyz of the instance passed.",
            (Query("min by (instance) (mcp_tasks_ready)", "{{instance}}"),),
            kind="stat",
            width=12,
        ),
    ],
}

# --- per tenant (needs MCP_TASKS_METRICS_TENANT_LABEL=true) --------------------------------------

TENANTS: dict[str, list[PanelSpec]] = {
    "Top tenants": [
        PanelSpec(
            "Top tenants by active tasks",
            "Non-terminal tasks per tenant, as of the last sweep.",
            (Query("topk(10, max by (tenant) (mcp_tasks_tenant_tasks_active))", "{{tenant}}"),),
            width=8,
        ),
        PanelSpec(
            "Top tenants by denials",
            "Requests refused for a tenant's principals (rate limits, caps, lookups of unknown ids).",
            (Query(f"topk(10, sum by (tenant) (rate(mcp_tasks_denials_total[{RATE}])))", "{{tenant}}"),),
            "reqps",
            width=8,
        ),
        PanelSpec(
            "Top tenants by tasks created",
            "Tasks created per second per tenant.",
            (
                Query(
                    f'topk(10, sum by (tenant) (rate(mcp_tasks_tasks_created_total{{tenant!=""}}[{RATE}])))',
                    "{{tenant}}",
                ),
            ),
            "ops",
            width=8,
        ),
        PanelSpec(
            "Top tenants by bytes kept",
            "What each tenant's tasks keep (arguments and results) against MCP_TASKS_TENANT_STORAGE_QUOTA_BYTES, "
            "as of the last sweep; at the quota its creates are refused (-32004 / -31004).",
            (Query("topk(10, max by (tenant) (mcp_tasks_tenant_storage_bytes))", "{{tenant}}"),),
            "bytes",
            width=24,
        ),
    ],
    "Tenant $tenant": [
        PanelSpec(
            "Tasks created by tool",
            "Tasks of the selected tenant created per second.",
            (Query(f'sum by (tool) (rate(mcp_tasks_tasks_created_total{{tenant="$tenant"}}[{RATE}]))', "{{tool}}"),),
            "ops",
        ),
        PanelSpec(
            "Tasks finished by outcome",
            "Terminal tasks of the selected tenant per second.",
            (
                Query(
                    f'sum by (outcome, status) (rate(mcp_tasks_tasks_finished_total{{tenant="$tenant"}}[{RATE}]))',
                    "{{outcome}} {{status}}",
                ),
            ),
            "ops",
        ),
        PanelSpec(
            "Denials by reason",
            "Requests of the selected tenant refused, by reason.",
            (Query(f'sum by (reason) (rate(mcp_tasks_denials_total{{tenant="$tenant"}}[{RATE}]))', "{{reason}}"),),
            "reqps",
        ),
    ],
}


def _datasource_variable() -> dashboard.DatasourceVariable:
    return dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")


def build(uid: str, title: str, description: str, rows: dict[str, list[PanelSpec]], tenant: bool) -> dict[str, object]:
    board = (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["mcp-task-service"])
        .time("now-3h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .editable()
        .with_variable(_datasource_variable())
    )
    if tenant:
        board = board.with_variable(
            dashboard.QueryVariable("tenant")
            .label("Tenant")
            .datasource(DS)
            .query('label_values(mcp_tasks_tasks_created_total{tenant!=""}, tenant)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .current(VariableOption(text="", value=""))
            .hide(VariableHide.DONT_HIDE)
        )
    panel_id = 0
    for row, specs in rows.items():
        panel_id += 1
        board = board.with_row(dashboard.Row(row).id(panel_id))
        for spec in specs:
            panel_id += 1
            board = board.with_panel(_panel(spec, panel_id))
    built: dict[str, object] = json.loads(json.dumps(board.build(), cls=JSONEncoder, sort_keys=True))
    return built


DASHBOARDS = {
    "mcp-tasks-overview.json": lambda: build(
        "mcp-tasks-overview", "mcp-task-service / Overview",
        "Requests, tasks, capacity, guards: the first dashboard to open (runbook: docs/operations.md).",
        OVERVIEW, tenant=False,
    ),
    "mcp-tasks-tenants.json": lambda: build(
        "mcp-tasks-tenants", "mcp-task-service / Tenants",
        "Per-tenant view; needs MCP_TASKS_METRICS_TENANT_LABEL=true (tenants past MCP_TASKS_METRICS_TENANT_LIMIT are 'other').",
        TENANTS, tenant=True,
    ),
}  # fmt: skip


def render(name: str) -> str:
    return json.dumps(DASHBOARDS[name](), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    stale = []
    for name in DASHBOARDS:
        path = HERE / name
        text = render(name)
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale dashboards {stale}: run python grafana/dashboards/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
