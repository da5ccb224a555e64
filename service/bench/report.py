"""What a person sees: the live progress line and the short summary, both on stderr."""

from __future__ import annotations

import sys
from time import perf_counter
from typing import Any, TextIO


class ProgressLine:
    """One self-overwriting stderr line; silent when disabled, so callers need not check."""

    def __init__(self, workload: str, enabled: bool, stream: TextIO | None = None) -> None:
        self._workload = workload
        self._enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._last_ops = 0
        self._last_at = perf_counter()
        self._shown = False

    def show(self, phase: str, elapsed_s: float, ops: int, errors: int, rate: float | None = None) -> None:
        """Redraw the line; ``rate`` defaults to the rate since the previous call."""
        if not self._enabled:
            return
        now = perf_counter()
        if rate is None:
            # The rate over the last interval, not since the start: a stall shows at once.
            rate = (ops - self._last_ops) / max(now - self._last_at, 1e-6) if ops >= self._last_ops else 0.0
        self._last_ops, self._last_at = ops, now
        self._stream.write(
            f"\r[bench {self._workload}] {phase:<9} {elapsed_s:6.1f}s  ops {ops:>9}  ops/s {rate:>9.0f}  errors {errors}   "
        )
        self._stream.flush()
        self._shown = True

    def reset_rate(self) -> None:
        """Start counting the rate afresh when a new phase restarts the op count."""
        self._last_ops, self._last_at = 0, perf_counter()

    def close(self) -> None:
        if self._shown:
            self._stream.write("\n")
            self._stream.flush()
            self._shown = False


# What an error kind says about the run, and what to change: (what happened, what to raise or lower).
# The settings named are ours (mcp-tasks serve); another server has its own names for the same limits.
_ADVICE: dict[str, tuple[str, str]] = {
    "http_429": (
        "refused with HTTP 429 (rate limited)",
        "raise the server's per-principal rate limit (ours: MCP_TASKS_RATE_LIMIT, default 1200/minute), "
        "spread the load over more principals (repeat --token), or lower --clients",
    ),
    "rpc_-32029": (
        "refused as rate limited (-32029)",
        "raise the server's rate limits (ours: MCP_TASKS_RATE_LIMIT, MCP_TASKS_RATE_LIMIT_NOT_FOUND for lookups "
        "that find nothing), spread the load over more principals (repeat --token), or lower --clients",
    ),
    "rpc_-32000": (
        "refused with -32000 (capacity exceeded: too many active tasks)",
        "raise the server's caps on active tasks (ours: MCP_TASKS_MAX_ACTIVE_TASKS_PER_REQUESTOR, default 16, and "
        "MCP_TASKS_MAX_ACTIVE_TASKS_PER_TENANT, default 256) above what the run holds at once (--clients, and "
        "--clients x --held for get), spread the load over more principals (repeat --token), or lower --clients",
    ),
    "rpc_-32004": (
        "refused with -32004 (storage quota: the tenant's tasks keep too many bytes)",
        "raise the server's storage quota (ours: MCP_TASKS_TENANT_STORAGE_QUOTA_BYTES, default 1 GiB), lower the "
        "retention the run's tasks ask for, or spread the load over more tenants",
    ),
    "rpc_-32001": (
        "refused with -32001 (service unavailable)",
        "check the server's database and its pool (ours: MCP_TASKS_DB_POOL_SIZE), or lower --clients",
    ),
    "http_503": ("refused with HTTP 503 (unavailable)", "check the server's health and logs, or lower --clients"),
    "timeout": ("timed out", "lower --clients, or check that the server is not stalled"),
}
# Past this share of failed operations the headline says the run measured refusals, not the server.
DOMINANT_SHARE = 0.5


def advice(error_kinds: dict[str, int], attempted: int) -> list[str]:
    """Lines saying what the failures were and which settings to raise or flags to lower (most
    frequent first); empty when nothing failed. The first line says whether errors dominate."""
    failed_requests = sum(error_kinds.values())
    if not failed_requests or attempted <= 0:
        return []
    lines: list[str] = []
    for kind, count in sorted(error_kinds.items(), key=lambda kv: (-kv[1], kv[0])):
        if kind in _ADVICE:
            what, fix = _ADVICE[kind]
            lines.append(f"{count} requests {what}: {fix}.")
        elif kind.startswith("transport_"):
            lines.append(f"{count} requests failed on the connection ({kind}): is the server up? Lower --clients.")
    if not lines:
        lines.append("see error_kinds; each names a failed request's HTTP status (http_*) or JSON-RPC code (rpc_*).")
    return lines


def errors_dominate(result: dict[str, Any]) -> bool:
    attempted = int(result.get("attempted") or 0)
    return attempted > 0 and int(result.get("errors") or 0) >= DOMINANT_SHARE * attempted


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary(result: dict[str, Any]) -> str:
    """A few lines for people; the JSON on stdout is the record."""
    attempted = result.get("attempted", result["ops"])
    lines = [
        f"{result['workload']} against {result['url']}: {result['clients']} clients, "
        f"{result['duration_s']:.2f} s, {result['ops']} successful ops, {result['throughput_per_s']:.1f} ops/s "
        f"(successful only), {result['errors']} of {attempted} operations failed"
    ]
    if errors_dominate(result):
        share = 100 * result["errors"] / attempted
        lines.append(
            f"  WARNING: errors dominate ({share:.1f} % of operations failed): this run measured the server's "
            "refusals, not its capacity."
        )
    for line in result.get("advice") or ():
        lines.append(f"  to fix: {line}")
    if result["error_kinds"]:
        kinds = ", ".join(f"{k}={n}" for k, n in sorted(result["error_kinds"].items()))
        lines.append(f"  error kinds: {kinds}")
    for method, m in result["methods"].items():
        lines.append(
            f"  {method:<13} n={m['count']:<8} err={m['errors']:<6} p50 {_ms(m['p50_ms'])} ms  "
            f"p95 {_ms(m['p95_ms'])} ms  p99 {_ms(m['p99_ms'])} ms  mean {_ms(m['mean_ms'])} ms"
        )
    server = result.get("server")
    if server:
        line = (
            f"  server: {server['cpu_s']:.2f} cpu-s ({_ms(server['cpu_ms_per_op'])} ms/op), "
            f"rss {server['rss_start_mib']:.1f} -> {server['rss_end_mib']:.1f} MiB (peak {server['rss_peak_mib']:.1f})"
        )
        if server["rss_growth_kib_per_1000_pending"] is not None:
            line += f", {server['rss_growth_kib_per_1000_pending']:.1f} KiB per 1000 pending tasks"
        lines.append(line)
    cleanup = result.get("cleanup")
    if cleanup and (cleanup["failed"] or cleanup["left"]):
        lines.append(
            f"  cleanup: {cleanup['cancelled']} cancelled, {cleanup['failed']} cancels failed, "
            f"{cleanup['left']} left to expire with their TTL"
        )
    return "\n".join(lines)
