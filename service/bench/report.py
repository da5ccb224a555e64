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


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary(result: dict[str, Any]) -> str:
    """A few lines for people; the JSON on stdout is the record."""
    lines = [
        f"{result['workload']} against {result['url']}: {result['clients']} clients, "
        f"{result['duration_s']:.2f} s, {result['ops']} ops, {result['throughput_per_s']:.1f} ops/s, "
        f"{result['errors']} errors"
    ]
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
