"""Latency samples, failures by method and kind, and the percentile summary of a run."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from time import perf_counter
from typing import Any

from service.bench.wire import RequestFailed, Session

# A check looks at a successful answer and names what is wrong with it (a failure kind), or returns None.
Check = Callable[[dict[str, Any]], str | None]


def any_result(result: dict[str, Any]) -> str | None:
    return None


def tool_result(result: dict[str, Any]) -> str | None:
    """A CallToolResult with isError is a failed call even though the request itself succeeded."""
    return "tool_error" if result.get("isError") is True else None


def created_task(result: dict[str, Any]) -> str | None:
    task = result.get("task")
    if isinstance(task, dict) and isinstance(task.get("taskId"), str):
        return None
    # Some servers answer a failing task-augmented call with a plain tool error instead of a task.
    return "tool_error" if result.get("isError") is True else "protocol_no_task"


def ext_created_task(result: dict[str, Any]) -> str | None:
    """A 2026-07-28 ``tools/call`` that must have become a task (a ``CreateTaskResult``, flat)."""
    if result.get("resultType") == "task" and isinstance(result.get("taskId"), str):
        return None
    if result.get("isError") is True:
        return "tool_error"
    # Answered synchronously: the workload measures tasks, so this run measures something else.
    return "not_a_task" if result.get("resultType") == "complete" else "protocol_no_task"


def ext_task_until_done(expected_text: str) -> Check:
    """A ``tasks/get`` of a lifecycle: still ``working`` (poll again), or ``completed`` with the
    tool's result inline whose first text is ``expected_text``; any other state is a failure."""

    def check(result: dict[str, Any]) -> str | None:
        status = result.get("status")
        if status == "working":
            return None
        if status != "completed":
            return f"task_{status}" if isinstance(status, str) else "protocol_no_status"
        inner = result.get("result")
        if not isinstance(inner, dict):
            return "protocol_no_inline_result"
        if inner.get("isError") is True:
            return "tool_error"
        content = inner.get("content")
        first = content[0] if isinstance(content, list) and content else None
        if not isinstance(first, dict) or first.get("text") != expected_text:
            return "wrong_result"
        return None

    return check


def ext_held_task(task_id: str) -> Check:
    """A ``tasks/get`` of a held task: that task, still running."""

    def check(result: dict[str, Any]) -> str | None:
        if result.get("taskId") != task_id:
            return "protocol_wrong_task"
        status = result.get("status")
        return None if status == "working" else f"task_{status}" if isinstance(status, str) else "protocol_no_status"

    return check


class Recorder:
    """Everything one phase observed; warm-up gets its own Recorder, which is thrown away."""

    __slots__ = ("failed_ops", "kinds", "method_errors", "op_samples", "ops", "samples")

    def __init__(self) -> None:
        # Successful requests' latencies in seconds, pooled over all clients: percentiles come from these.
        self.samples: dict[str, list[float]] = {}
        self.method_errors: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.op_samples: list[float] = []
        self.ops = 0
        self.failed_ops = 0

    async def call(
        self, session: Session, method: str, params: dict[str, Any], check: Check = any_result
    ) -> dict[str, Any] | None:
        """Send one request and record it; None means it failed (already counted)."""
        started = perf_counter()
        try:
            result = await session.request(method, params)
        except RequestFailed as failure:
            self.fail(method, failure.kind)
            return None
        elapsed = perf_counter() - started
        if (kind := check(result)) is not None:
            self.fail(method, kind)
            return None
        samples = self.samples.get(method)
        if samples is None:
            samples = self.samples[method] = []
        samples.append(elapsed)
        return result

    def fail(self, method: str, kind: str) -> None:
        self.method_errors[method] += 1
        self.kinds[kind] += 1

    def op_done(self, ok: bool, elapsed: float) -> None:
        self.ops += 1
        if ok:
            self.op_samples.append(elapsed)
        else:
            self.failed_ops += 1

    def successes(self, method: str) -> int:
        return len(self.samples.get(method, ()))

    def methods(self) -> dict[str, dict[str, Any]]:
        """Per method: requests sent (count), failed ones, and percentiles of the successful ones."""
        names = sorted(set(self.samples) | set(self.method_errors))
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            samples = self.samples.get(name, [])
            errors = self.method_errors[name]
            out[name] = {"count": len(samples) + errors, "errors": errors, **latency_summary(samples)}
        return out


def latency_summary(samples: list[float]) -> dict[str, float | None]:
    """p50/p95/p99 (nearest rank) and mean in milliseconds; None when there is nothing to summarise."""
    if not samples:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "mean_ms": None}
    ordered = sorted(samples)
    n = len(ordered)

    def rank(q: float) -> float:
        return round(ordered[max(0, math.ceil(q * n) - 1)] * 1000, 3)

    return {
        "p50_ms": rank(0.50),
        "p95_ms": rank(0.95),
        "p99_ms": rank(0.99),
        "mean_ms": round(sum(ordered) / n * 1000, 3),
    }
