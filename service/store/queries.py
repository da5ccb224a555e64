"""Named SQL: each ``sql/*.sql`` file holds ``-- name: x`` blocks, loaded once at import of the store."""

from __future__ import annotations

import re
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


def _load() -> dict[str, str]:
    found: dict[str, str] = {}
    for entry in sorted(resources.files("service.store").joinpath("sql").iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        text = entry.read_text(encoding="utf-8")
        parts = _NAME.split(text)
        # parts = [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
            sql = "\n".join(lines).strip().rstrip(";")
            if name in found:
                raise RuntimeError(f"duplicate SQL query name {name!r} in {entry.name}")
            found[name] = sql
    return found


Q: dict[str, str] = _load()
