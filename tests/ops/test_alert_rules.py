"""Alert rules: promtool checks them, and a unit test makes every alert fire and stay quiet."""

from __future__ import annotations

import subprocess
from collections import defaultdict
from typing import Any

import yaml

from tests.ops.conftest import ROOT, tool

ALERTS_DIR = ROOT / "grafana" / "alerts"
RULES = ALERTS_DIR / "mcp-tasks.rules.yaml"
TESTS = ALERTS_DIR / "mcp-tasks.rules.test.yaml"


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules() -> None:
    done = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_pass() -> None:
    done = subprocess.run(
        [tool("promtool"), "test", "rules", TESTS.name], capture_output=True, text=True, cwd=ALERTS_DIR
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    seen: dict[str, set[bool]] = defaultdict(set)
    for case in yaml.safe_load(TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            seen[check["alertname"]].add(bool(check["exp_alerts"]))
    for rule in alert_rules():
        assert seen[rule["alert"]] == {True, False}, f"{rule['alert']}: needs a firing and a quiet case"


def test_every_alert_has_a_severity_a_summary_and_a_runbook_anchor() -> None:
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["runbook_url"].startswith("docs/operations.md#"), rule["alert"]


def test_the_runbook_has_a_section_for_every_alert() -> None:
    runbook = (ROOT / "docs" / "operations.md").read_text()
    anchors = {line.removeprefix("### ").strip().lower() for line in runbook.splitlines() if line.startswith("### ")}
    for rule in alert_rules():
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in anchors, f"{rule['alert']}: no '### ' section with anchor #{anchor} in docs/operations.md"
        assert rule["alert"] in runbook, rule["alert"]
