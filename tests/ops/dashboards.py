"""The dashboards' generator and the queries it produces, for the tests."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from types import ModuleType
from typing import Any

from tests.ops.conftest import ROOT

DASHBOARD_DIR = ROOT / "grafana" / "dashboards"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mcp_tasks_dashboards", DASHBOARD_DIR / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def committed() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("mcp-tasks-*.json"))}


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) of every target of every panel."""
    out = []
    for name, board in committed().items():
        for panel in board["panels"]:
            for target in panel.get("targets") or []:
                out.append((name, panel["title"], target["expr"]))
    return out


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bmcp_tasks[a-z0-9_:]*", expr))
