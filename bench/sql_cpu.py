"""PostgreSQL backend CPU per item of the group-commit functions (issue 15, point 2).

Calls task_create, a lease renewal (a heartbeat with every task due), task_finish and
task_retrieve directly, a batch of 32 per statement and one commit each, on a scratch database migrated with ``mcp-tasks migrate``; the
backends' CPU (utime + stime of /proc/<pid>/stat) is read before and after, so the number is
PostgreSQL's own work, not the client's. One requestor (32 items of one tenant and subject) and
spread (8 tenants x 4 subjects). PostgreSQL must run on this machine.

    .venv/bin/python bench/sql_cpu.py --dsn postgresql://postgres@127.0.0.1/scratch --rounds 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
from typing import Any

import asyncpg

from service.store.queries import Q

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)


def owners(spread: bool) -> list[tuple[str, str]]:
    if not spread:
        return [("solo", "alice")] * 32
    return [(f"t{t}", f"s{s}") for t in range(8) for s in range(4)]


def create(tenant: str, subject: str) -> dict[str, Any]:
    return {
        "tenant_id": tenant, "task_id": secrets.token_urlsafe(16), "subject": subject,
        "issuer": "https://issuer.test", "client_id": "c", "session_id": None, "wire": "2025-11-25",
        "tool": "echo", "arguments": {"text": "x"}, "client_capabilities": {}, "progress_token": None,
        "ttl_ms": 3_600_000, "poll_interval_ms": 100, "max_per_requestor": 10**9, "max_per_tenant": 10**9,
        "request_id": "r", "client_address": "127.0.0.1", "detail": {"tool": "echo"},
        "lease_owner": "runner-1", "lease_ms": 60_000, "rerunnable": True, "tool_version": None,
    }  # fmt: skip


async def run(dsn: str, rounds: int, spread: bool, analyze: bool = True) -> dict[str, float]:
    app = await asyncpg.connect(dsn)
    runner = await asyncpg.connect(dsn)
    await app.execute("SET ROLE mcp_tasks_app")
    await runner.execute("SET ROLE mcp_tasks_runner")
    app_pid = await app.fetchval("SELECT pg_backend_pid()")
    runner_pid = await runner.fetchval("SELECT pg_backend_pid()")
    spent = {"create": 0.0, "renew": 0.0, "finish": 0.0, "retrieve": 0.0}
    renew = Q["renew_leases"]
    await runner.execute(Q["publish_runner"], "runner-1", "{}", 3_600_000)  # its row: the lease on its tasks
    try:
        for r in range(rounds + 10):  # the first 10 warm up (plans, caches)
            items = sorted(
                (create(t, s) for t, s in owners(spread)), key=lambda i: (i["tenant_id"], i["subject"], i["task_id"])
            )
            before = cpu_s(app_pid)
            rows = await app.fetch("SELECT task_id FROM task_create($1::jsonb)", json.dumps(items))
            assert all(row["task_id"] for row in rows)
            created = cpu_s(app_pid) - before
            before = cpu_s(runner_pid)
            ids = [[i["tenant_id"] for i in items], [i["task_id"] for i in items], [0] * len(items)]
            rows = await runner.fetch(renew, "runner-1", 60_000, *ids, 240_000)
            assert len([row for row in rows if row["task_id"] is not None]) == len(items)
            renewed = cpu_s(runner_pid) - before
            finishes = [
                {"tenant_id": i["tenant_id"], "task_id": i["task_id"], "owner": "runner-1", "status": "completed",
                 "outcome": "result", "payload": {"content": [], "isError": False}, "status_message": None,
                 "detail": {"outcome": "result"}, "epoch": 0}
                for i in items
            ]  # fmt: skip
            before = cpu_s(runner_pid)
            rows = await runner.fetch("SELECT task_id FROM task_finish($1::jsonb)", json.dumps(finishes))
            assert all(row["task_id"] for row in rows)
            finished = cpu_s(runner_pid) - before
            lookups = [{**i, "detail": None} for i in items]
            before = cpu_s(app_pid)
            rows = await app.fetch("SELECT task_id FROM task_retrieve($1::jsonb)", json.dumps(lookups))
            assert all(row["task_id"] for row in rows)
            retrieved = cpu_s(app_pid) - before
            if r == 9 and analyze:  # fresh statistics, as a live database has (the plans are made again)
                await app.execute(
                    "RESET ROLE; ANALYZE tasks, active_tasks, audit_events, audit_heads, audit_retrievals; SET ROLE mcp_tasks_app"
                )
            if r >= 10:
                spent["create"] += created
                spent["renew"] += renewed
                spent["finish"] += finished
                spent["retrieve"] += retrieved
    finally:
        await app.close()
        await runner.close()
    return {k: v / (rounds * 32) * 1e6 for k, v in spent.items()}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument(
        "--no-analyze", action="store_true",
        help="never ANALYZE: the plans a young table gets before its first statistics (autovacuum off)",
    )  # fmt: skip
    args = parser.parse_args()
    for spread in (False, True):
        us = await run(args.dsn, args.rounds, spread, analyze=not args.no_analyze)
        label = "8 tenants x 4 subjects" if spread else "one requestor"
        print(f"{label:24} " + "  ".join(f"{k} {v:6.1f} us/item" for k, v in us.items()))


if __name__ == "__main__":
    asyncio.run(main())
