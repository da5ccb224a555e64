"""The catalog of a database as comparable text: ``pg_dump --schema-only``, normalised."""

from __future__ import annotations

import difflib
import itertools
import re
import shutil
import subprocess

# pg_dump heads every object with "-- Name: <name>; Type: <type>; Schema: ...".
_HEADER = re.compile(r"^-- Name: (?P<name>.*?); Type: (?P<type>[^;]*);", re.MULTILINE)
_IGNORED = "alembic_version"  # the migration tool's bookkeeping, not the schema


def schema_objects(dsn: str) -> dict[str, str]:
    """Every object but alembic_version, as "<type> <name>" → its normalised statements, in pg_dump's order.

    Comments, SET lines, psql meta-commands and blank lines are dropped and runs of whitespace
    collapsed, so indentation (inside function bodies too) does not count; everything else does:
    tables, columns, constraints, indexes, types, functions and their bodies, triggers, policies,
    row-level security and grants."""
    # No skip without pg_dump: a check that can quietly not run is no check (CI has it).
    pg_dump = shutil.which("pg_dump")
    if pg_dump is None:
        raise RuntimeError("the schema tests need pg_dump: install the PostgreSQL client tools")
    done = subprocess.run(
        [pg_dump, "--schema-only", "--no-owner", "--dbname", dsn], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:  # e.g. a pg_dump older than the server
        raise RuntimeError(f"pg_dump failed: {done.stderr.strip()}")
    raw = done.stdout
    objects: dict[str, str] = {}
    starts = [m.start() for m in _HEADER.finditer(raw)] + [len(raw)]
    for start, end in itertools.pairwise(starts):
        header = _HEADER.match(raw, start)
        assert header is not None
        if _IGNORED in header["name"]:
            continue
        lines = []
        for line in raw[start:end].splitlines():
            line = " ".join(line.split())
            if not line or line.startswith(("--", "SET ", "\\", "SELECT pg_catalog.set_config('search_path'")):
                continue
            lines.append(line)
        if lines:
            objects[f"{header['type']} {header['name']}"] = "\n".join(lines) + "\n"
    return objects


def schema_dump(dsn: str) -> str:
    """The whole normalised catalog as one text (see schema_objects)."""
    return "\n".join(f"-- {key}\n{text}" for key, text in schema_objects(dsn).items())


def object_diff(left: dict[str, str], right: dict[str, str], left_name: str, right_name: str) -> str:
    """A unified diff per object that differs, headed by the object: what a developer needs to see."""
    parts = []
    for key in list(left) + [k for k in right if k not in left]:
        a, b = left.get(key, ""), right.get(key, "")
        if a == b:
            continue
        state = "only in " + (left_name if not b else right_name) if not (a and b) else "differs"
        diff = difflib.unified_diff(
            a.splitlines(keepends=True), b.splitlines(keepends=True), left_name, right_name, n=2
        )
        parts.append(f"=== {key}: {state}\n{''.join(diff)}")
    return "\n".join(parts)
