"""PostgreSQL connections killed under load (issue 13, points 4 and 7)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import asyncpg
import pytest

from tests.conftest import http_client
from tests.faults.harness import FaultClient, OperationFailed, Tally, db_name, figures, judge, replicas, settle

KILL_ROUNDS = 10
KILL_EVERY_S = 1.0
# The event hub's LISTEN connection is a connection of its own (service/store/events.py): killed
# with the pools, or spared.
SPARE_LISTEN = " AND application_name <> 'mcp-tasks-listen'"


@pytest.mark.parametrize(
    ("name", "which"),
    [
        pytest.param("pg-connections-killed", SPARE_LISTEN, id="pool-connections"),
        # The LISTEN connection too: a lost wake-up is found by the polls, and nothing of a lease
        # depends on a connection (the runner's row does).
        pytest.param("pg-connections-killed+listen", "", id="every-backend"),
    ],
)
async def test_killed_database_connections_show_clients_only_503_and_lose_nothing(
    database_url: str, tmp_path: Path, name: str, which: str
) -> None:
    """Issue 13, point 7 (PostgreSQL connections killed with pg_terminate_backend under load, the
    test's own database only): clients see only 503 / -32001 while it lasts, no task is lost, none
    is stuck, none runs twice; the replica recovers (ready again, no traceback). Once with the pool
    connections only (point 4), once with every backend, the LISTEN connection too."""
    runs_log = tmp_path / "runs.log"
    tally = Tally()
    known: dict[str, str] = {}
    stop = asyncio.Event()
    killed = 0
    admin = await asyncpg.connect(database_url)
    try:
        async with (
            replicas(database_url, tmp_path, ("a",), FAULTS_RUNS_LOG=str(runs_log)) as fleet,
            http_client() as http,
        ):
            a = fleet["a"]

            async def traffic(seed: int) -> None:
                client = FaultClient(http, [a.url], tally, seed)
                with contextlib.suppress(OperationFailed):
                    await client.initialize()
                    n = 0
                    while not stop.is_set():
                        n += 1
                        if n % 4 == 0:  # a plain call (no task) now and then
                            await client.request("tools/call", {"name": "echo", "arguments": {"text": "hi"}})
                            continue
                        tool = "work_once" if n % 2 else "work"
                        task_id = await client.create(tool, {"seconds": 0.1 + 0.3 * (n % 5)})
                        known[task_id] = tool
                        await client.follow(task_id, use_result=n % 3 == 0)

            clients = [asyncio.create_task(traffic(i)) for i in range(6)]
            await asyncio.sleep(1.5)  # load is flowing
            for _ in range(KILL_ROUNDS):
                killed += await admin.fetchval(
                    "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    f" WHERE datname = $1 AND pid <> pg_backend_pid(){which}) AS k",
                    db_name(database_url),
                )
                await asyncio.sleep(KILL_EVERY_S)
            await asyncio.sleep(2)  # and after it, load flows again
            stop.set()
            await asyncio.gather(*clients)
            rows = await settle(database_url, set(known), timeout=20)
            ready = (await http.get(a.base + "/readyz")).status_code
            log = a.log()
    finally:
        await admin.close()

    lost, stuck, duplicated, runs = judge(rows, known, runs_log)
    failed_tasks = sum(1 for t in known if t in rows and rows[t]["status"] != "completed")
    unexpected = {k: n for k, n in tally.retries.items() if k not in ("http503", "rpc-32001")}
    figures(
        name,
        failed_ops=tally.failed_ops, lost=lost, stuck=stuck, duplicated=len(duplicated),
        ops=tally.ops, retried=tally.retried, unexpected_errors=sum(unexpected.values()),
        tasks=len(known), tasks_not_completed=failed_tasks, backends_killed=killed,
    )  # fmt: skip
    print(f"  retries by kind: {dict(tally.retries)}; failures: {dict(tally.failures)} {tally.examples}")
    assert killed >= KILL_ROUNDS  # the fault really happened
    assert (tally.failed_ops, lost, stuck, len(duplicated)) == (0, 0, 0, 0), (
        tally.examples,
        {t: (dict(rows[t]) if t in rows else None, runs[t]) for t in duplicated},
        log[-3000:],
    )
    assert not unexpected, unexpected
    assert failed_tasks == 0, {t: dict(rows[t]) for t in known if rows[t]["status"] != "completed"}
    assert ready == 200  # recovered
    assert "Traceback" not in log, log[-4000:]
