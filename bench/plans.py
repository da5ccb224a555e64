"""The plan report (`make plans`): the service's hot queries as PostgreSQL plans them, on tables
shaped as a deployment will hold them, each plan checked for what the query's design counts on.

A plan is the planner's choice: a PostgreSQL release or other statistics may change it while the
service stays right, so these checks are not tests (`make test` checks what the service does).
Run this after a change to SQL or indexes, and in a tuning pass. Each group of checks builds a
scratch database of its own on the server of ``--dsn`` (migrated with ``mcp-tasks migrate``, as
bench/sql_ab.py does), shapes its data, and drops it. One line per check: the query, what is
expected, what the plan showed, ok or FAIL; the exit status is 1 if any check failed.

    .venv/bin/python bench/plans.py --dsn postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from service.store.queries import Q

ADMIN = os.environ.get("MCP_TASKS_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BIN = Path(__file__).resolve().parent.parent / ".venv" / "bin"
APP, RUNNER = "mcp_tasks_app", "mcp_tasks_runner"
LEASE = "runner-1"


@dataclass(frozen=True)
class Check:
    query: str
    expected: str
    showed: str
    ok: bool

    def line(self) -> str:
        return f"{self.query} | {self.expected} | {self.showed} | {'ok' if self.ok else 'FAIL'}"


# --- scratch databases and data ----------------------------------------------------------------


def with_db(dsn: str, name: str) -> str:
    base, _, query = dsn.partition("?")
    base = base.rsplit("/", 1)[0] + "/" + name
    return f"{base}?{query}" if query else base


@contextlib.asynccontextmanager
async def scratch(admin_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A fresh database migrated by `mcp-tasks migrate`, dropped afterwards; a superuser's connection
    to it (statements run as the service's roles with ``as_role``)."""
    name = f"mcp_tasks_plans_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        dsn = with_db(admin_dsn, name)
        env = {**os.environ, "MCP_TASKS_DATABASE_URL": dsn}
        await asyncio.to_thread(
            subprocess.run, [str(BIN / "mcp-tasks"), "migrate"], env=env, check=True, capture_output=True
        )
        conn = await asyncpg.connect(dsn)
        try:
            yield conn
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def as_role(
    conn: asyncpg.Connection, role: str, sql: str, *args: Any, tenant: str | None = None
) -> list[asyncpg.Record]:
    """One statement in its own transaction as one of the service's roles (under row-level
    security), scoped to ``tenant`` as a request's statements are."""
    async with conn.transaction():
        await conn.execute(f"SET LOCAL ROLE {role}")
        if tenant is not None:
            await conn.execute("SELECT set_config('app.tenant_id', $1, true)", tenant)
        return await conn.fetch(sql, *args)


async def plan_of(
    conn: asyncpg.Connection, role: str, options: str, sql: str, *args: Any, tenant: str | None = None
) -> dict[str, Any]:
    """The top node of ``EXPLAIN (options, FORMAT JSON) sql`` as ``role``."""
    [row] = await as_role(conn, role, f"EXPLAIN ({options}, FORMAT JSON) {sql}", *args, tenant=tenant)
    top: dict[str, Any] = json.loads(row[0])[0]["Plan"]
    return top


def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]


def scans(plan: dict[str, Any]) -> str:
    """The plan's reads of tasks, in plan order: the kind of scan, the index if any, estimated rows."""
    found = [
        f"{n['Node Type']} {n.get('Index Name') or n['Relation Name']} ~{n['Plan Rows']:g}"
        for n in nodes(plan)
        if "Scan" in n["Node Type"]
        and (n.get("Relation Name") == "tasks" or n.get("Index Name", "").startswith("tasks"))
    ]
    return ", ".join(found) or "no read of tasks"


def seq_scans_of_tasks(plan: dict[str, Any]) -> int:
    return sum(1 for n in nodes(plan) if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "tasks")


def estimates(plan: dict[str, Any], index: str) -> list[float]:
    return [n["Plan Rows"] for n in nodes(plan) if n.get("Index Name") == index]


def item(tenant: str, subject: str, **fields: Any) -> dict[str, Any]:
    """A task_create item, as the service's batcher sends one (leased to ``LEASE`` unless told)."""
    return {
        "tenant_id": tenant, "task_id": secrets.token_urlsafe(12), "subject": subject,
        "issuer": "https://issuer.test", "client_id": "c", "session_id": None, "wire": "2025-11-25",
        "tool": "echo", "arguments": {"text": "x"}, "client_capabilities": {}, "progress_token": None,
        "ttl_ms": 600_000, "poll_interval_ms": 100, "max_per_requestor": 10**6, "max_per_tenant": 10**6,
        "request_id": "r", "client_address": "127.0.0.1", "detail": {"tool": "echo"},
        "lease_owner": LEASE, "lease_ms": 600_000, "rerunnable": True, "tool_version": None,
    } | fields  # fmt: skip


async def create(conn: asyncpg.Connection, items: list[dict[str, Any]]) -> list[asyncpg.Record]:
    """task_create as the app role, items in the batcher's (tenant, subject, task) order."""
    ordered = sorted(items, key=lambda i: (i["tenant_id"], i["subject"], i["task_id"]))
    return await as_role(conn, APP, "SELECT * FROM task_create($1::jsonb)", json.dumps(ordered))


async def finish(conn: asyncpg.Connection, items: list[dict[str, Any]]) -> None:
    """task_finish as the runner role: each item completed with a result."""
    done = sorted(
        ({"tenant_id": i["tenant_id"], "task_id": i["task_id"], "owner": LEASE, "status": "completed",
          "outcome": "result", "payload": {"content": [], "isError": False}, "status_message": None,
          "detail": {"outcome": "result"}, "epoch": 0, "subject": i["subject"]} for i in items),
        key=lambda f: (f["tenant_id"], f["task_id"]),
    )  # fmt: skip
    await as_role(conn, RUNNER, "SELECT * FROM task_finish($1::jsonb)", json.dumps(done))


async def store_finished(conn: asyncpg.Connection, n: int) -> None:
    """``n`` finished tasks of acme/alice, inserted directly (the connection is a superuser's)."""
    await conn.execute(
        """INSERT INTO tasks (tenant_id, task_id, subject, wire, tool, arguments, status, outcome, payload,
                              ttl_ms, poll_interval_ms, expires_at, finished_at)
           SELECT 'acme', 'old-' || g, 'alice', '2025-11-25', 'echo', '{}', 'completed', 'result', '{}',
                  600000, 100, clock_timestamp() + interval '10 minutes', clock_timestamp()
           FROM generate_series(1, $1::int) g""",
        n,
    )


# --- the checks ---------------------------------------------------------------------------------


async def queue_gauges(conn: asyncpg.Connection) -> list[Check]:
    """There is no index of every active task per requestor: queue_by_tool (the queue gauges, once
    per maintenance pass) counts the queued and the running tasks per tool from the two partial
    indexes of exactly those rows, not by a scan of every stored task.

    Planned as the runner role that runs it, under row-level security, where the planner may not
    use the most common values of ``status`` (the enum's ``=`` is not leakproof). Before, it took
    the queued tasks for half of a table of finished ones (1 over the status's count of distinct
    values), and with a million stored chose a scan of the table; the null test in ``tasks_queued``
    tells it how few they are. The pass's other reader of the queue, mark_tasks_without_runner, is
    planned the same way. (Was tests/test_batch_record.py.)"""
    queued = [item("acme", "alice", tool="slow", lease_owner=None, lease_ms=None) for _ in range(3)]
    running = [item("acme", "bob", tool="slow") for _ in range(2)] + [item("globex", "carol")]
    done = [item("acme", "alice") for _ in range(3)]
    await create(conn, queued + running + done)
    await finish(conn, done)
    stored = 20_000
    await store_finished(conn, stored)
    await conn.execute("ANALYZE tasks")
    checks = []
    for name in ("queue_by_tool", "mark_tasks_without_runner"):
        plan = await plan_of(conn, RUNNER, "COSTS", Q[name])
        queue = estimates(plan, "tasks_queued")
        # The planner knows the queue is small: 3 of 20,000 (it said 10,000 without the null test).
        ok = not seq_scans_of_tasks(plan) and bool(queue) and max(queue) <= stored / 100
        checks.append(Check(name, f"no Seq Scan of tasks; tasks_queued read, estimated <= {stored // 100} rows of {stored:,}",
                            scans(plan), ok))  # fmt: skip
    plan = await plan_of(conn, RUNNER, "COSTS", Q["queue_by_tool"])
    indexes = sorted({n["Index Name"] for n in nodes(plan) if n.get("Index Name")})
    checks.append(Check("queue_by_tool", "reads the indexes tasks_leased and tasks_queued alone",
                        f"indexes {', '.join(indexes) or 'none'}", indexes == ["tasks_leased", "tasks_queued"]))  # fmt: skip
    return checks


def rows_touched(plan: dict[str, Any]) -> int:
    """Rows every node of an EXPLAIN ANALYZE plan produced or filtered away, over all its loops."""
    loops = plan.get("Actual Loops", 1)
    own = sum(plan.get(key, 0) for key in ("Actual Rows", "Rows Removed by Filter", "Rows Removed by Join Filter"))
    return int(own * loops) + sum(rows_touched(child) for child in plan.get("Plans", []))


async def maintenance_stays_linear(conn: asyncpg.Connection) -> list[Check]:
    """docs/decisions.md, "Runners publish what they run": the pass decides per (tool, version) and
    joins no queued row with another, so a young table the planner knows nothing about cannot make
    it quadratic (it once spent 8 s of PostgreSQL per pass with 6,400 tasks queued). Both shapes:
    every message to write (no runner), then nothing to change. (Was tests/test_runner_tools.py.)"""
    items = [
        item(f"t{n % 4}", f"s{n % 3}", tool="hang" if n % 2 else "echo", lease_owner=None, lease_ms=None)
        for n in range(600)
    ]
    await create(conn, items)
    bound = 20 * len(items)
    checks = []
    for shape in ("every message written", "nothing changed"):
        plan = await plan_of(conn, RUNNER, "ANALYZE", Q["mark_tasks_without_runner"])
        touched = rows_touched(plan)
        checks.append(Check(f"mark_tasks_without_runner ({shape})",
                            f"rows touched < {bound:,} (20 x {len(items)} queued, no statistics)",
                            f"rows touched {touched:,}", touched < bound))  # fmt: skip
    return checks


async def get_by_primary_key(conn: asyncpg.Connection) -> list[Check]:
    """task_get reads an item's row by primary key however many tasks its subject holds, on a table
    the planner knows nothing about (a new deployment; no ANALYZE yet). Joined on the subject too,
    the planner walked tasks_owner_recent, every task of the subject, to find one: one principal's
    gets ran at half the speed of spread ones. Counted in buffers (EXPLAIN BUFFERS counts the
    function's own statements), not in time. (Was tests/test_group_commit.py.)"""
    held: list[str] = []
    for _ in range(48):  # as the batcher sends them: 64 creates a statement
        rows = await create(conn, [item("acme", "alice", lease_owner=None, lease_ms=None) for _ in range(64)])
        held += [r["task_id"] for r in rows if r["task_id"]]
    never_analysed = await conn.fetchval("SELECT reltuples < 0 FROM pg_class WHERE relname = 'tasks'")
    wanted = held[len(held) // 2]
    args = (["acme"], [wanted], ["alice"])
    async with conn.transaction():
        await conn.execute(f"SET LOCAL ROLE {APP}")
        found = [r["task_id"] for r in await conn.fetch(Q["task_get"], *args)]  # its plans made now
        plan_text = await conn.fetchval(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM task_get($1, $2, $3)", *args
        )
    top = json.loads(plan_text)[0]["Plan"]
    blocks = top["Shared Hit Blocks"] + top["Shared Read Blocks"]
    # By primary key: an index root and leaf and the heap page (5 measured); the walk took 19 for 2,048.
    ok = never_analysed and found == [wanted] and top["Actual Rows"] == 1 and blocks <= 12
    return [Check("task_get", f"1 row of {len(held):,} of one subject, <= 12 buffers, table never analysed",
                  f"{top['Actual Rows']} row, {blocks} buffers, never analysed: {never_analysed}", ok)]  # fmt: skip


async def lists_output(conn: asyncpg.Connection) -> list[Check]:
    """Issue 14 §4 (eight clients listing large tasks took the server from 229 to 980 MB): the list
    queries' plans output none of arguments, capabilities or payload (their top node's Output, so no
    step carries those wide values either). tests/security/test_client_data_limits.py checks the
    columns they return; this, what the plan reads."""
    [row] = await create(conn, [item("acme", "alice", arguments={"text": "a" * 200_000})])
    created_at = await conn.fetchval("SELECT created_at FROM tasks WHERE task_id = $1", row["task_id"])
    checks = []
    for name, args in (
        ("list_tasks_first", ("acme", "alice", 11)),
        ("list_tasks_after", ("acme", "alice", created_at, "~", 11)),
    ):
        plan = await plan_of(conn, APP, "VERBOSE", Q[name], *args, tenant="acme")
        wide = sorted({"arguments", "client_capabilities", "payload"} & {c.split(".")[-1] for c in plan["Output"]})
        checks.append(Check(name, "outputs no arguments, client_capabilities or payload",
                            f"outputs {', '.join(wide) or 'none of them'}", not wide))  # fmt: skip
    return checks


async def claim_plan(conn: asyncpg.Connection) -> dict[str, Any]:
    """claim_tasks planned as the runner role, under row-level security, as the service runs it."""
    args = (f"explain:{secrets.token_hex(4)}", 120_000, 16, ["echo"], 16, ["t1"], [16], "{}", ["t1"], ["s1"], [3])
    return await plan_of(conn, RUNNER, "COSTS", Q["claim_tasks"], *args)


async def fair_claim(conn: asyncpg.Connection) -> list[Check]:
    """Issue 14 finding 2: fairness must not cost a scan of the table. With 20,000 queued tasks of
    200 tenants, the oldest 256 of a tenant at its share (the claim skips them), it reads
    tasks_queued, oldest first. Planned as the service runs it, as the runner role under row-level
    security: before migration 0018 its policy's condition (no column) was estimated at 0.5 % of
    the rows, and the window of a queue this long was a scan of the table and a sort of it all.

    Migration 0017: with 200,000 finished tasks stored beside a few queued (what a deployment holds
    for most of its life), the claim reads tasks_queued too, and the planner sees how few rows it
    holds. With ``status = 'working'`` in the index's predicate it estimated them from the status's
    count of distinct values alone (the enum's ``=`` may not read its most common values under
    row-level security): half the table or all of it, and with a million stored it scanned the
    table. (Was tests/security/test_fair_scheduling.py.)"""
    await conn.execute(
        """INSERT INTO tasks (tenant_id, task_id, subject, wire, tool, arguments, ttl_ms,
                              poll_interval_ms, expires_at, created_at)
           SELECT CASE WHEN g <= 256 THEN 't1' ELSE 't' || (g % 200) END, 'task-' || g, 's' || (g % 3),
                  '2025-11-25', 'echo', '{}', 60000, 100,
                  now() + interval '1 hour', now() - (20000 - g) * interval '1 millisecond'
           FROM generate_series(1, 20000) AS g"""
    )
    await conn.execute("ANALYZE tasks")
    crowded = await claim_plan(conn)
    stored = 200_000
    await conn.execute("DELETE FROM tasks WHERE task_id NOT IN ('task-1', 'task-2', 'task-300')")
    await conn.execute(
        """INSERT INTO tasks (tenant_id, task_id, subject, wire, tool, arguments, status, outcome, payload,
                              ttl_ms, poll_interval_ms, expires_at, created_at, finished_at)
           SELECT 't' || (g % 200), 'done-' || g, 's1', '2025-11-25', 'echo', '{}', 'completed', 'result', '{}',
                  60000, 100, now() + interval '1 hour', now() - interval '1 minute', now()
           FROM generate_series(1, $1::int) AS g""",
        stored,
    )
    await conn.execute("ANALYZE tasks")
    quiet = await claim_plan(conn)
    checks = []
    for shape, plan in (("20,000 queued", crowded), (f"3 queued, {stored:,} finished", quiet)):
        ok = not seq_scans_of_tasks(plan) and bool(estimates(plan, "tasks_queued"))
        checks.append(Check(f"claim_tasks ({shape})", "no Seq Scan of tasks; reads tasks_queued", scans(plan), ok))
    # The queue's rows as the planner sees them: 3 of 200,003 (many times more with `status = 'working'`).
    queue = estimates(quiet, "tasks_queued")
    checks.append(Check(f"claim_tasks (3 queued, {stored:,} finished)",
                        f"tasks_queued estimated <= {stored // 1000} rows",
                        f"estimated {max(queue) if queue else 'no scan of it'}", bool(queue) and max(queue) <= stored / 1000))  # fmt: skip
    return checks


GROUPS: dict[str, Callable[[asyncpg.Connection], Awaitable[list[Check]]]] = {
    "queue-gauges": queue_gauges,
    "maintenance": maintenance_stays_linear,
    "get": get_by_primary_key,
    "lists": lists_output,
    "claim": fair_claim,
}


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=ADMIN, help="a superuser's URL of the server to build scratch databases on")
    ap.add_argument("--only", action="append", choices=list(GROUPS), help="this group of checks (repeatable)")
    args = ap.parse_args()
    failed = 0
    for name in args.only or GROUPS:
        try:
            async with scratch(args.dsn) as conn:
                checks = await GROUPS[name](conn)
        except Exception as exc:  # a query or a shape that no longer fits: a failed check, not a crash
            checks = [Check(name, "the check runs", f"{type(exc).__name__}: {exc}", False)]
        for check in checks:
            print(check.line(), flush=True)
            failed += not check.ok
    print(f"plans: {'all ok' if not failed else f'{failed} check(s) FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
