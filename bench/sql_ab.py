"""PostgreSQL CPU per lifecycle item under SQL variants, the variants' rounds alternated (issue 15).

bench/sql_cpu.py measures one schema at a time; on a shared machine its numbers move by 20 % from
one run to the next, more than most changes of a statement. Here each variant (a SQL file applied
after ``mcp-tasks migrate``: a changed function, a dropped index, nothing at all for the schema as
it stands) gets a fresh database of its own, and every round runs a batch of creates, gets,
finishes and retrieves on each variant in turn (the order swapped every round), as the service's
batches do: the machine's drift falls on all of them alike. The backends' CPU comes from
``/proc/<pid>/schedstat`` (nanoseconds). Two copies of the same file measure what noise is left
(0.3-3 % on this machine).

    .venv/bin/python bench/sql_ab.py --rounds 300 --batch 16 --tenants 8 /dev/null variant.sql

Two things to know when writing a variant: ``CREATE OR REPLACE`` of a function resets what an
``ALTER FUNCTION`` gave it (``SECURITY DEFINER``, its ``SET`` clauses), so restate them; and the
numbers are per item of batches of ``--batch``, one commit per statement, not per lifecycle of the
service (the load decides its batches).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sql_cpu import create  # the same create items

from service.store.queries import Q

ADMIN = os.environ.get("MCP_TASKS_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BIN = Path(__file__).resolve().parent.parent / ".venv" / "bin"
STEPS = ("create", "get", "finish", "retrieve")


def cpu_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


class Variant:
    def __init__(self, sql: str) -> None:
        self.sql = sql
        self.db = f"mcp_tasks_sql_ab_{secrets.token_hex(4)}"
        self.spent = dict.fromkeys(STEPS, 0)

    async def open(self) -> None:
        admin = await asyncpg.connect(ADMIN)
        try:
            await admin.execute(f'CREATE DATABASE "{self.db}"')
        finally:
            await admin.close()
        dsn = ADMIN.rsplit("/", 1)[0] + "/" + self.db
        await asyncio.to_thread(self._migrate, dsn)
        self.app = await asyncpg.connect(dsn, server_settings={"role": "mcp_tasks_app"})
        self.runner = await asyncpg.connect(dsn, server_settings={"role": "mcp_tasks_runner"})
        self.app_pid = await self.app.fetchval("SELECT pg_backend_pid()")
        self.runner_pid = await self.runner.fetchval("SELECT pg_backend_pid()")
        await self.runner.execute(Q["publish_runner"], "runner-1", "{}", 3_600_000)

    def _migrate(self, dsn: str) -> None:
        env = {**os.environ, "MCP_TASKS_DATABASE_URL": dsn}
        subprocess.run([str(BIN / "mcp-tasks"), "migrate"], env=env, check=True, capture_output=True)
        if Path(self.sql).is_file() and Path(self.sql).stat().st_size:
            subprocess.run(["psql", "-q", "-v", "ON_ERROR_STOP=1", dsn, "-f", self.sql], check=True)

    async def close(self) -> None:
        for conn in (getattr(self, "app", None), getattr(self, "runner", None)):
            if conn is not None:
                await conn.close()
        admin = await asyncpg.connect(ADMIN)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')
        finally:
            await admin.close()

    async def _timed(self, conn: asyncpg.Connection, pid: int, sql: str, *args: Any) -> tuple[list[Any], int]:
        before = cpu_ns(pid)
        async with conn.transaction():
            rows = await conn.fetch(sql, *args)
        return rows, cpu_ns(pid) - before

    async def round(self, owners: list[tuple[str, str]], counted: bool) -> None:
        items = sorted((create(t, s) for t, s in owners), key=lambda i: (i["tenant_id"], i["subject"], i["task_id"]))
        ids = [[i[k] for i in items] for k in ("tenant_id", "task_id", "subject")]
        rows, c = await self._timed(self.app, self.app_pid, Q["task_create"], json.dumps(items))
        assert all(row["task_id"] for row in rows), "a create was refused"
        rows, g = await self._timed(self.app, self.app_pid, Q["task_get"], *ids)
        assert len(rows) == len(items), "a get found nothing"
        finishes = sorted(
            ({"tenant_id": i["tenant_id"], "task_id": i["task_id"], "owner": "runner-1", "status": "completed",
              "outcome": "result", "payload": {"content": [{"type": "text", "text": "x"}]}, "status_message": None,
              "detail": {"outcome": "result"}, "epoch": 0} for i in items),
            key=lambda f: (f["tenant_id"], f["task_id"]),
        )  # fmt: skip
        rows, f = await self._timed(self.runner, self.runner_pid, Q["task_finish"], json.dumps(finishes))
        assert all(row["task_id"] for row in rows), "a finish was refused"
        lookups = [{**i, "detail": None} for i in items]
        rows, r = await self._timed(self.app, self.app_pid, Q["task_retrieve"], json.dumps(lookups))
        assert all(row["task_id"] for row in rows), "a retrieve found nothing"
        if counted:
            for step, ns in zip(STEPS, (c, g, f, r), strict=True):
                self.spent[step] += ns

    async def analyze(self) -> None:
        tables = "tasks, active_tasks, audit_events, audit_heads, audit_retrievals"
        await self.app.execute(f"RESET ROLE; ANALYZE {tables}; SET ROLE mcp_tasks_app")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="items per statement (default %(default)s)")
    ap.add_argument("--tenants", type=int, default=8, help="the 32 requestors' tenants (default %(default)s)")
    ap.add_argument("variants", nargs="+", help="SQL files applied after migrating (/dev/null: the schema as is)")
    args = ap.parse_args()
    variants = [Variant(sql) for sql in args.variants]
    owners = [(f"tenant-{i % args.tenants}", f"user-{i}") for i in range(32)]
    warm = 20
    try:
        for v in variants:
            await v.open()
        for r in range(args.rounds + warm):
            picked = [owners[(r * args.batch + j) % len(owners)] for j in range(args.batch)]
            for v in variants if r % 2 else variants[::-1]:
                await v.round(picked, counted=r >= warm)
                if r == warm - 1:  # statistics, as a live database has them (plans are made again)
                    await v.analyze()
    finally:
        for v in variants:
            await v.close()
    n = args.rounds * args.batch
    print(f"PostgreSQL CPU, us per item (batches of {args.batch}, {args.tenants} tenant(s)):")
    for v in variants:
        steps = "  ".join(f"{step} {v.spent[step] / n / 1000:6.1f}" for step in STEPS)
        print(f"{Path(v.sql).name:28} {steps}  total {sum(v.spent.values()) / n / 1000:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
