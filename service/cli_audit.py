"""``mcp-tasks audit trail``: every audit row about one task, or what one subject did, for a reviewer;
each row with its chain position (tenant, seq, hash) so it can be checked against ``audit verify``.

One tenant's rows at a time, read as ``mcp_tasks_app`` with that tenant set, so row-level security
keeps the others out (docs/decisions.md, "Audit trails"). Without ``--tenant`` the tenant is the one
whose chain records the task's creation, or the only one with rows of the subject."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any

from service.cli_exit import NOT_FOUND, USAGE, CommandError
from service.cli_records import parse_time, print_table, record_database

COLUMNS = ("tenant_id", "seq", "hash", "at", "action", "outcome", "subject", "client_id", "client_address",
           "request_id", "task_id", "wire")  # fmt: skip


def add_parser(audit_sub: Any) -> None:
    trail = audit_sub.add_parser("trail", help="every row about one task (--task), or what one subject did (--subject)")
    what = trail.add_mutually_exclusive_group(required=True)
    what.add_argument("--task", default=None, metavar="ID")
    what.add_argument("--subject", default=None, metavar="S")
    trail.add_argument("--tenant", default=None, help="the tenant whose chain to read (see docs/decisions.md)")
    trail.add_argument("--since", default=None, help="ISO 8601 time; required with --subject")
    trail.add_argument("--until", default=None, help="ISO 8601 time (with --subject)")
    trail.add_argument("--json", action="store_true", help="JSON lines: every field, full hashes")


def _row(event: dict[str, Any]) -> dict[str, Any]:
    detail = event.get("detail") if isinstance(event.get("detail"), dict) else {}
    return {**event, "at": event["at"].isoformat(), "wire": (detail or {}).get("wire")}


async def _tenant(store: Any, args: argparse.Namespace, since: datetime | None) -> str:
    if args.tenant is not None:
        return str(args.tenant)
    if args.task is not None:
        found = await store.tenants_creating(args.task)
        if not found:
            raise CommandError(NOT_FOUND, f"mcp-tasks audit trail: no chain records the creation of task {args.task} "
                                          "(unknown, or purged); name the chain with --tenant")  # fmt: skip
        return str(found[0])
    assert since is not None
    found = await store.tenants_of_subject(args.subject, since)
    if len(found) > 1:  # a subject name is one identity per tenant: never mix them
        raise CommandError(USAGE, f"mcp-tasks audit trail: subject {args.subject!r} has rows in {len(found)} "
                                  f"tenants ({', '.join(found)}); name one with --tenant")  # fmt: skip
    return str(found[0]) if found else ""


async def trail_main(args: argparse.Namespace) -> int:
    from service.store.db import APP_ROLE, RUNNER_ROLE
    from service.store.usage import AuditTrailStore

    since, until = parse_time("--since", args.since), parse_time("--until", args.until)
    if args.subject is not None and since is None:
        raise CommandError(USAGE, "mcp-tasks audit trail: --subject needs --since (an ISO 8601 time)")
    async with record_database(APP_ROLE, "audit trail") as rows_db:
        if args.tenant is None:
            async with record_database(RUNNER_ROLE, "audit trail") as lookup_db:
                tenant = await _tenant(AuditTrailStore(rows_db, lookup_db), args, since)
        else:
            tenant = args.tenant
        store = AuditTrailStore(rows_db)
        if not tenant:
            events = []
        elif args.task is not None:
            events = await store.of_task(tenant, args.task)
        else:
            assert since is not None
            events = await store.of_subject(tenant, args.subject, since, until)
    rows = [_row(e) for e in events]
    if args.json:
        for row in rows:
            sys.stdout.write(json.dumps(row, separators=(",", ":"), default=str) + "\n")
        sys.stdout.flush()
        return 0
    short = [[*(r[c] for c in COLUMNS[:2]), r["hash"][:12], *(r[c] for c in COLUMNS[3:])] for r in rows]
    print_table(COLUMNS, short, "text")
    return 0
