"""``mcp-tasks usage``: tasks and task-seconds per tenant (and tool) in a time range, from the audit
record, and plain calls, kept beside it per hour — the source for billing and budgets
(docs/operations.md, "Usage per tenant")."""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

from service.cli_records import parse_time, print_table, record_database

COUNTS = ("created", "completed", "failed", "cancelled", "expired", "plain_calls")


def add_parser(sub: Any) -> None:
    usage = sub.add_parser("usage", help="tasks, task-seconds and plain calls per tenant (and tool)")
    usage.add_argument("--tenant", default=None, help="one tenant (default: every tenant)")
    usage.add_argument("--since", default=None, help="from this ISO 8601 time on (default: the record's start)")
    usage.add_argument("--until", default=None, help="before this ISO 8601 time (default: now)")
    usage.add_argument("--by", choices=["tenant", "tool"], default="tenant", help="one row per tenant, or per tool")
    out = usage.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_const", dest="format", const="json", help="one JSON object per row")
    out.add_argument("--csv", action="store_const", dest="format", const="csv", help="CSV with a header row")


async def usage_main(args: argparse.Namespace) -> int:
    from service.store.db import RUNNER_ROLE
    from service.store.usage import UsageStore

    since, until = parse_time("--since", args.since), parse_time("--until", args.until)
    async with record_database(RUNNER_ROLE, "usage") as db:
        report = await UsageStore(db).report(args.tenant, since, until)
    by_tool = args.by == "tool"
    totals: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0] * (len(COUNTS) + 1))
    for u in report:
        key = (u.tenant_id, u.tool) if by_tool else (u.tenant_id,)
        values = (u.created, u.completed, u.failed, u.cancelled, u.expired, u.plain_calls, u.task_seconds)
        for i, value in enumerate(values):
            totals[key][i] += value
    header = ["tenant", *(["tool"] if by_tool else []), *COUNTS, "task_seconds"]
    rows = [[*key, *(int(v) for v in values[:-1]), round(values[-1], 3)] for key, values in sorted(totals.items())]
    print_table(header, rows, args.format or "text")
    return 0
