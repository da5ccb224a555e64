"""Dashboards: generated from code, committed as generated, valid against Grafana's dashboard schema."""

from __future__ import annotations

import json
import re

import jsonschema
import yaml
from prometheus_client import REGISTRY

from service.observability import metrics
from tests.ops.conftest import ROOT
from tests.ops.dashboards import committed, generator, metric_names, panel_queries

SCHEMA = json.loads((ROOT / "grafana" / "schema" / "dashboard.jsonschema.json").read_text())
RULES = yaml.safe_load((ROOT / "grafana" / "alerts" / "mcp-tasks.rules.yaml").read_text())


def known_series() -> set[str]:
    """Every series name the service can expose, plus the recording rules."""
    metrics.configure(tenant_label=False)  # registers the scrape-time pool collector
    names = set()
    for family in REGISTRY.collect():  # every family, even one with no sample yet
        if family.name.startswith("mcp_tasks_"):
            kind = family.type
            names.add(family.name + ("_total" if kind == "counter" else ""))
            if kind == "histogram":
                names |= {family.name + s for s in ("_bucket", "_count", "_sum")}
    names |= {r["record"] for g in RULES["groups"] for r in g["rules"] if "record" in r}
    return names


def test_committed_json_is_what_the_code_generates() -> None:
    gen = generator()
    for name in gen.DASHBOARDS:
        assert (ROOT / "grafana" / "dashboards" / name).read_text() == gen.render(name), (
            f"{name} is stale: run python grafana/dashboards/generate.py"
        )
    assert gen.main(["--check"]) == 0


def test_dashboards_are_valid_against_grafanas_dashboard_schema() -> None:
    validator = jsonschema.Draft7Validator(SCHEMA)
    for name, board in committed().items():
        errors = [f"{list(e.path)}: {e.message[:200]}" for e in validator.iter_errors(board)]
        assert errors == [], name


def test_panels_have_unique_ids_titles_and_queries() -> None:
    for name, board in committed().items():
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in board["panels"]:
            if panel["type"] != "row":
                assert panel["targets"], f"{name}: {panel['title']} has no query"
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_overview_covers_what_on_call_needs_first() -> None:
    titles = " | ".join(p["title"] for p in committed()["mcp-tasks-overview.json"]["panels"]).lower()
    for topic in (
        "request rate", "latency", "errors", "created", "finished by outcome", "active", "waiting for input",
        "first claim", "run time", "runner utilisation", "pool", "batch", "rate-limit denials", "cap refusals",
        "authentication failures", "audit write failures", "sweeper", "reaper",
    ):  # fmt: skip
        assert topic in titles, topic


def test_every_query_names_only_metrics_the_service_exposes() -> None:
    known = known_series()
    for name, title, expr in panel_queries():
        unknown = metric_names(expr) - known
        assert not unknown, f"{name} / {title}: {sorted(unknown)} not in service/observability/metrics.py"
    for group in RULES["groups"]:
        for rule in group["rules"]:
            unknown = metric_names(rule["expr"]) - known
            assert not unknown, f"{rule.get('alert') or rule.get('record')}: {sorted(unknown)}"


def test_tenant_dashboard_has_a_tenant_variable_used_by_its_tenant_row() -> None:
    board = committed()["mcp-tasks-tenants.json"]
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "tenant"]
    assert any(re.search(r'tenant="\$tenant"', expr) for _n, _t, expr in panel_queries())
