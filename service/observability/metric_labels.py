"""Bounded label values for the metrics: known methods and wires, JSON-RPC codes, remembered children."""

from __future__ import annotations

from typing import Final, TypeVar

from prometheus_client import Counter, Histogram

KNOWN_METHODS: Final = frozenset(
    {
        "initialize", "ping", "tools/list", "tools/call", "tasks/get", "tasks/result", "tasks/list", "tasks/cancel",
        "resources/list", "resources/templates/list", "resources/read", "resources/subscribe",
        "resources/unsubscribe", "prompts/list", "prompts/get", "logging/setLevel", "completion/complete",
        "server/discover", "tasks/update", "subscriptions/listen",
    }
)  # fmt: skip
KNOWN_WIRES: Final = frozenset({"2025-11-25", "2025-06-18", "2025-03-26", "2026-07-28"})

_M = TypeVar("_M", Counter, Histogram)
_children: dict[tuple[object, tuple[str, ...]], object] = {}


def labelled(metric: _M, *values: str) -> _M:
    """``metric.labels(*values)``, remembered: prometheus-client takes a lock, converts and hashes
    the values on every call, and a request names three or four children. Label values are
    bounded (service.observability.metrics says how), so the table is too; it starts afresh if
    that ever stops being true."""
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


# The service's application codes on the 2026-07-28 wire (service.mcp.jsonrpc: capacity, unavailable,
# rate limited), outside JSON-RPC's reserved range; -31001 is a fault the error budget counts.
APPLICATION_CODES: Final = frozenset({-31000, -31001, -31004, -31029})


def rpc_code(code: int | None) -> str:
    """Bounded error-code label: JSON-RPC's reserved range and our application codes as they are,
    anything else 'other'."""
    if code is None:
        return "other"
    return str(code) if -32768 <= code <= -32000 or code in APPLICATION_CODES else "other"


def method(value: str) -> str:
    """Bounded method label: unknown methods are 'other'."""
    return value if value in KNOWN_METHODS else "other"
