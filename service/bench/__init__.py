"""Load generator for any MCP Tasks endpoint (``mcp-tasks bench``)."""

from __future__ import annotations

from service.bench.loadgen import BenchConfig, BenchError, BenchUsageError, main, run_bench

__all__ = ["BenchConfig", "BenchError", "BenchUsageError", "main", "run_bench"]
