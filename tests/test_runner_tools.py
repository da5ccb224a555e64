"""Issue 13, point 3 (rest): runners publish the tools they run; a task whose tool no live runner
has stays queued and says so (statusMessage, a gauge, an alert); claims respect the tool's version;
the reaper decides re-run or fail from the task's own record, not from its own tool packs."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable

import asyncpg
import httpx
import orjson
import pytest
from prometheus_client import REGISTRY

from service.runtime.maintenance import Maintenance
from service.store.db import RUNNER_ROLE, Database
from service.store.queries import Q
from service.tools.registry import Registry
from tests.conftest import make_settings, serve
from tests.rpc import RpcSession
from tests.test_batch_record import create, ordered
from tests.test_durability import mcp_tasks

pytestmark = pytest.mark.slow


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(0.05)


def without_runner(tool: str) -> float | None:
    return REGISTRY.get_sample_value("mcp_tasks_tasks_without_runner", {"tool": tool})


async def test_a_task_whose_tool_no_live_runner_has_waits_and_says_so_until_one_comes(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 13, point 3: the task stays working (queued), its statusMessage names the missing tool,
    the gauge counts it; a runner with the tool then takes it, and the message goes with the claim."""
    front = make_settings(database_url, runner_concurrency=0)  # accepts with both packs, runs nothing
    demo_only = make_settings(database_url, tools="service.tools.demo")
    async with serve(front) as running, serve(demo_only):
        s = RpcSession(http, running.url)
        await s.initialize()
        waiting = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        runnable = (await s.call_tool_as_task("echo", {"text": "x"}))["task"]["taskId"]

        async def told() -> bool:
            task = await s.result("tasks/get", {"taskId": waiting})
            return "hang" in (task.get("statusMessage") or "")

        async def ran() -> bool:  # a task of a tool a runner has runs meanwhile
            return (await s.result("tasks/get", {"taskId": runnable}))["status"] == "completed"

        await wait_for(told)
        await wait_for(ran)
        task = await s.result("tasks/get", {"taskId": waiting})
        assert task["status"] == "working"

        async def counted() -> bool:
            return without_runner("hang") == 1.0

        await wait_for(counted)
        assert (without_runner("echo") or 0.0) == 0.0

        async with serve(make_settings(database_url)):  # a runner with both packs joins

            async def claimed_and_cleared() -> bool:
                task = await s.result("tasks/get", {"taskId": waiting})
                return task["status"] == "working" and task.get("statusMessage") is None and await leased(waiting)

            async def leased(task_id: str) -> bool:
                db = await asyncpg.connect(database_url)
                try:
                    return await db.fetchval("SELECT lease_owner IS NOT NULL FROM tasks WHERE task_id = $1", task_id)
                finally:
                    await db.close()

            await wait_for(claimed_and_cleared)

            async def back_to_zero() -> bool:
                return without_runner("hang") == 0.0

            await wait_for(back_to_zero)
            await s.result("tasks/cancel", {"taskId": waiting})


async def test_a_stopped_runner_withdraws_its_tools_and_the_message_returns(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 13, point 3: "live" is a runner that renews its word; one
    that stops takes its tools back at once, so the next queued task of that tool is told."""
    db = await asyncpg.connect(database_url)
    try:
        async with serve(make_settings(database_url, runner_concurrency=0)) as running:
            async with serve(make_settings(database_url, tools="service.tools.demo,tests.toolpack")):
                tools = orjson.loads(await db.fetchval("SELECT tools FROM runners"))
                assert tools["hang"] == {"version": None, "rerunnable": False}
                assert tools["sleep"] == {"version": None, "rerunnable": True}
            assert await db.fetchval("SELECT count(*) FROM runners") == 0
            s = RpcSession(http, running.url)
            await s.initialize()
            task_id = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]

            async def told() -> bool:
                return bool((await s.result("tasks/get", {"taskId": task_id})).get("statusMessage"))

            await wait_for(told)
    finally:
        await db.close()


async def test_the_maintenance_pass_tells_every_queued_task_without_a_runner_and_counts_them_per_tool(
    database_url: str,
) -> None:
    """docs/decisions.md, "Runners publish what they run": with no live runner, one pass writes the
    message on every queued task and returns the count per tool; the next finds nothing to change
    and counts the same. That the pass stays linear in the queue on a table without statistics (it
    once spent 8 s of PostgreSQL per pass with 6,400 tasks queued) is a plan: `make plans`
    (bench/plans.py) checks it."""
    items = ordered([
        create(f"t{n % 4}", f"s{n % 3}", tool="hang" if n % 2 else "echo", lease_owner=None,
               lease_ms=None) for n in range(600)
    ])  # fmt: skip
    db = await asyncpg.connect(database_url)
    try:
        await db.execute("SET ROLE mcp_tasks_app")
        await db.fetch("SELECT task_id FROM task_create($1::jsonb)", json.dumps(items))
        await db.execute(f"RESET ROLE; SET ROLE {RUNNER_ROLE}")
        for _ in ("every message written", "nothing changed"):
            counts = {r["tool"]: r["without_runner"] for r in await db.fetch(Q["mark_tasks_without_runner"])}
            assert counts == {"hang": 300, "echo": 300}
            told = await db.fetchval("SELECT count(*) FROM tasks WHERE status_message LIKE 'queued: no connected%'")
            assert told == len(items)
    finally:
        await db.close()


async def test_a_task_accepted_for_one_version_of_its_tool_waits_for_that_version(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 13, point 3 ("a compatible tool version"; docs/decisions.md, "Tool versions"): a runner
    with another version of the tool leaves the task queued, told why; one with its version runs it."""
    front = make_settings(database_url, runner_concurrency=0, tools="tests.versioned_pack:v2")
    async with serve(front) as running, serve(make_settings(database_url, tools="tests.versioned_pack:v1")):
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("stamp", {"text": "a"}))["task"]["taskId"]

        async def told() -> bool:
            return "'2'" in ((await s.result("tasks/get", {"taskId": task_id})).get("statusMessage") or "")

        await wait_for(told)
        assert (await s.result("tasks/get", {"taskId": task_id}))["status"] == "working"
        async with serve(make_settings(database_url, tools="tests.versioned_pack:v2")):
            async with asyncio.timeout(20):
                result = await s.result("tasks/result", {"taskId": task_id})
    assert result["content"][0]["text"] == "v2:a"


async def test_a_reaper_without_the_tools_pack_re_runs_a_rerunnable_task_and_fails_the_other(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 13, point 3 (the reaper's rerunnable decision): the process that finds a dead runner's
    tasks loads neither tool; it re-queues the task whose tool may re-run (sleep) and fails the one
    whose tool may not (hang), as recorded when each was accepted."""
    async with serve(make_settings(database_url, runner_concurrency=0, sweep_interval_ms=600_000)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        again = (await s.call_tool_as_task("sleep", {"seconds": 600}))["task"]["taskId"]
        once = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        admin = await asyncpg.connect(database_url)
        try:
            # A runner claimed both and died: its leases ran out (only then does the reaper take them,
            # docs/decisions.md "Fencing").
            await admin.execute(
                "UPDATE tasks SET lease_owner = 'dead-runner', attempts = 1,"
                " lease_expires_at = clock_timestamp() - interval '1 second' WHERE task_id = ANY($1)",
                [again, once],
            )
            db = Database(database_url, pool_size=2, role=RUNNER_ROLE)
            await db.open()
            try:
                reaper = Maintenance(db, Registry([]), interval_s=60, session_idle_ms=3_600_000)
                assert await reaper.reap_lost_leases() == 2
            finally:
                await db.close()
            rows = {
                r["task_id"]: r
                for r in await admin.fetch(
                    "SELECT task_id, status, lease_owner, payload FROM tasks WHERE task_id = ANY($1)", [again, once]
                )
            }
        finally:
            await admin.close()
    assert (rows[again]["status"], rows[again]["lease_owner"]) == ("working", None)
    assert rows[once]["status"] == "failed"


async def test_a_killed_workers_tasks_are_decided_by_their_record_on_a_replica_without_the_pack(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 13, point 3, end to end: a worker with the tests pack runs slow_fail (rerunnable) and
    hang (not) and is killed; the only reaper loads the demo pack alone. It re-queues slow_fail,
    which then waits, told that no live runner has it, and fails hang, never to run twice."""
    front = make_settings(database_url, runner_concurrency=0, sweep_interval_ms=600_000)  # never reaps here
    db = await asyncpg.connect(database_url)
    try:
        async with serve(front) as running:
            s = RpcSession(http, running.url)
            await s.initialize()
            again = (await s.call_tool_as_task("slow_fail", {"seconds": 600}))["task"]["taskId"]
            once = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
            # A short lease: the reaper takes a dead runner's tasks once their leases ran out (Fencing).
            async with mcp_tasks("worker", database_url, MCP_TASKS_LEASE_MS="3000") as (worker, _url):

                async def both_claimed() -> bool:
                    n = await db.fetchval(
                        "SELECT count(*) FROM tasks WHERE task_id = ANY($1) AND lease_owner IS NOT NULL", [again, once]
                    )
                    return bool(n == 2)

                await wait_for(both_claimed)
                worker.send_signal(signal.SIGKILL)
                await asyncio.to_thread(worker.wait, 10)
            async with serve(make_settings(database_url, runner_concurrency=0, tools="service.tools.demo")):

                async def decided() -> bool:
                    a = await s.result("tasks/get", {"taskId": again})
                    b = await s.result("tasks/get", {"taskId": once})
                    return (
                        a["status"] == "working"
                        and "slow_fail" in (a.get("statusMessage") or "")
                        and (b["status"] == "failed")
                    )

                await wait_for(decided)
            row = await db.fetchrow("SELECT lease_owner, attempts FROM tasks WHERE task_id = $1", again)
            assert (row["lease_owner"], row["attempts"]) == (None, 1)
    finally:
        await db.close()
