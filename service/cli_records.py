"""What the operator's record commands share: the database they read (the configured URL, or the
embedded one), ISO 8601 times, and tables as text, CSV or JSON lines."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import sys
from collections.abc import AsyncIterator, Coroutine, Sequence
from datetime import datetime
from typing import Any

from service.cli_exit import BROKEN_PIPE, INTERRUPTED, USAGE, CommandError


def parse_time(flag: str, text: str | None) -> datetime | None:
    """An ISO 8601 time; one without an offset is UTC (the record's times are)."""
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(USAGE, f"{flag} {text!r} is not an ISO 8601 time, e.g. 2026-11-01T00:00:00+00:00") from None
    if value.tzinfo is None:
        from datetime import UTC

        value = value.replace(tzinfo=UTC)
    return value


@contextlib.asynccontextmanager
async def record_database(role: str, command: str) -> AsyncIterator[Any]:
    """A small pool on MCP_TASKS_DATABASE_URL (checked to be at this version's schema), or on the
    embedded database of MCP_TASKS_DATA_DIR, acting as ``role``."""
    from service.cli_config import load_settings
    from service.core import check_schema
    from service.store.db import Database
    from service.store.embedded import start_embedded

    settings = load_settings()
    dsn = settings.database_url
    try:
        if dsn:
            await check_schema(dsn)
        else:
            dsn = await asyncio.to_thread(start_embedded, settings.data_dir)
        db = Database(dsn, pool_size=2, role=role)
        await db.open()
    except (RuntimeError, OSError) as exc:  # unreachable, at another schema, or a role it may not take
        raise CommandError(1, f"mcp-tasks {command}: {exc}") from None
    try:
        yield db
    finally:
        await db.close()


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str) -> None:
    """``fmt``: "text" (aligned columns), "csv", or "json" (one object per row)."""
    if fmt == "json":
        for row in rows:
            print(json.dumps(dict(zip(header, row, strict=True)), separators=(",", ":"), default=str))
    elif fmt == "csv":
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow(header)
        out.writerows(rows)
    else:
        cells = [[str(c) for c in header], *[["" if c is None else str(c) for c in row] for row in rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        for r in cells:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    sys.stdout.flush()


def run_record_command(main: Coroutine[Any, Any, int]) -> int:
    """Run ``usage`` or ``audit trail`` to its exit code: errors, Ctrl-C (130) and a closed stdout
    (141) are one line or none, as for the client commands (``service.cli_exit``)."""
    import os

    try:
        return asyncio.run(main)
    except CommandError as exc:
        print(exc.line, file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("\nmcp-tasks: interrupted; nothing was changed", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
