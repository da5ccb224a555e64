"""Render the chart offline with Helm v4's SDK (helm-python-sdk) and parse the manifests."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

from tests.ops.conftest import ROOT

CHART = ROOT / "helm" / "mcp-task-service"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
helm.disable_logging()  # the SDK logs an INFO line for the rule file's symlink on every load
logging.getLogger("helm_python").setLevel(logging.WARNING)


def values_of(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the chart renders for these values (an install named `rel` in `tasks`)."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        rendered = chart.render(values, name="rel", namespace="tasks", is_install=True)
    objects = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def notes(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="rel", namespace="tasks", is_install=True)
    return next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]
