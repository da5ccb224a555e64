"""Ops checks: slow ones (a fresh venv, a live Prometheus) run only under `make ops-check`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VIRTUAL_ENV") or ROOT / ".venv") / "bin"


def tool(name: str) -> str:
    """A tool from the project's venv (installed by the dev extra), else from PATH."""
    found = BIN / name
    if found.exists():
        return str(found)
    on_path = shutil.which(name)
    if on_path is None:
        pytest.fail(f"{name} is not installed: `make` installs the dev extra, apt-get installs promtool")
    return on_path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("MCP_TASKS_OPS_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow ops check: run by `make ops-check` (MCP_TASKS_OPS_SLOW=1)")
    for item in items:
        if "slow" in item.keywords and "tests/ops/" in str(item.path):
            item.add_marker(skip)
