"""Database pool use, read from the pools at every scrape (exact, unlike the sweeper's gauges)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


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


def register_pool_collector() -> None:
    """Once per process: the pool gauges join the default registry."""
    global _pool_collector
    if _pool_collector is None:
        _pool_collector = _PoolCollector()
        REGISTRY.register(_pool_collector)
