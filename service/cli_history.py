"""The tasks ``mcp-tasks call`` created over 2026-07-28, remembered on this machine: that wire has no
``tasks/list``, so ``mcp-tasks tasks list`` asks the server about these (``tasks/get``) beside the
2025-11-25 list. Only ids and URLs are kept; the server still decides who may see each task."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

# Hosted mode's longest TTL is a day by default; older entries are dropped when the file is written.
KEEP_S = 2 * 86_400
KEEP_ENTRIES = 200


@dataclass(frozen=True)
class Remembered:
    url: str
    task_id: str
    at: float


def history_file() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "mcp-tasks" / "cli-tasks.jsonl"


def remembered(url: str) -> list[Remembered]:
    """The tasks remembered for this endpoint, newest first."""
    return [r for r in _read() if r.url == url][::-1]


def remember(url: str, task_id: str) -> None:
    """Best effort: a history that cannot be written costs only the listing, never the call."""
    now = time.time()
    kept = [r for r in _read() if now - r.at < KEEP_S][-(KEEP_ENTRIES - 1) :]
    kept.append(Remembered(url, task_id, now))
    path = history_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r.__dict__) + "\n" for r in kept))
        tmp.chmod(0o600)
        tmp.replace(path)
    except OSError:
        pass


def _read() -> list[Remembered]:
    try:
        lines = history_file().read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
            out.append(Remembered(str(entry["url"]), str(entry["task_id"]), float(entry["at"])))
        except (ValueError, KeyError, TypeError):
            continue
    return out
