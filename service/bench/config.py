"""What a bench run is asked to do, and the checks that refuse unsafe or unbounded requests."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal
from urllib.parse import urlsplit

# The 2025-11-25 ones, then the 2026-07-28 Tasks extension's (service.bench.v2026).
WORKLOADS: Final = ("plain", "lifecycle", "get", "create", "ext-lifecycle", "ext-get")


class BenchUsageError(ValueError):
    """The configuration is refused before any request is sent (exit status 2)."""


class BenchError(RuntimeError):
    """The run could not be set up (sessions or held tasks failed); nothing was measured."""


@dataclass(frozen=True)
class BenchConfig:
    """One bench run: the endpoint, the workload, the load's shape and what to measure (see run_bench)."""

    url: str
    workload: Literal["plain", "lifecycle", "get", "create", "ext-lifecycle", "ext-get"]
    clients: int = 32
    duration_s: float = 10.0
    warmup_s: float = 1.0
    max_ops: int | None = None
    held: int = 200
    tokens: Sequence[str] = field(default=(), repr=False)  # never printed or logged
    tool: str = "echo"
    hold_tool: str = "sleep"
    ttl_ms: int = 3_600_000
    task_seconds: float = 0.005  # ext-lifecycle: the hold tool's {seconds} (a task that ends almost at once)
    poll_ms: float = 5.0  # ext-lifecycle: tasks/get again after this long while the task is working
    server_pid: int | None = None
    allow_remote: bool = False
    progress: bool = True


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def validate(config: BenchConfig) -> None:
    """Refuse what would be unsafe or unbounded; raises BenchUsageError."""
    parts = urlsplit(config.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchUsageError(f"url must be an http(s) URL with a host, got {config.url!r}")
    # Names are not resolved: only a literal loopback address or "localhost" counts as local.
    if not config.allow_remote and not _is_loopback(parts.hostname):
        raise BenchUsageError(f"{parts.hostname} is not a loopback address; pass --allow-remote to load it")
    checks = [
        (not isinstance(config.tokens, str), "tokens must be a list of tokens, not one string"),
        (config.workload in WORKLOADS, f"workload must be one of {', '.join(WORKLOADS)}"),
        (1 <= config.clients <= 10_000, "clients must be in 1..10000"),
        (0 < config.duration_s <= 86_400, "duration must be in (0, 86400] seconds"),
        (0 <= config.warmup_s <= 3_600, "warmup must be in [0, 3600] seconds"),
        (config.max_ops is None or config.max_ops >= 1, "max-ops must be at least 1"),
        (1 <= config.held <= 100_000, "held must be in 1..100000"),
        (config.ttl_ms >= 1, "ttl must be at least 1 ms"),
        (0 <= config.task_seconds <= 3_600, "task-seconds must be in [0, 3600]"),
        (0 <= config.poll_ms <= 60_000, "poll-ms must be in [0, 60000]"),
    ]
    for ok, message in checks:
        if not ok:
            raise BenchUsageError(message)
