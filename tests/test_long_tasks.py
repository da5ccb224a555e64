"""Long tasks (issue 43), on both wires: a task's lifetime follows its work (the granted ttl is
retention after the end, T-TTL-2/4, X-TTL-2), a runtime limit that always holds, across takeovers
too, and an input timeout (docs/decisions.md, "Retention after the end", "A runtime limit")."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from service.tools.registry import Registry
from tests.conftest import make_settings, serve
from tests.ext import V2026Client
from tests.rpc import RpcSession
from tests.test_durability import ROOT


def at(ts: str) -> datetime:
    return datetime.fromisoformat(ts.replace("Z", "+00:00"))


def expiry(task: dict[str, Any], ttl_key: str) -> datetime:
    """When the task says it will be deleted: createdAt + ttl."""
    return at(task["createdAt"]) + timedelta(milliseconds=task[ttl_key])


async def until(read: Any, done: Any, timeout: float = 20) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            value: dict[str, Any] = await read()
            if done(value):
                return value
            await asyncio.sleep(0.05)


async def watch_working(read: Any, ttl_key: str, retention_ms: int) -> tuple[list[int], dict[str, Any]]:
    """Poll a task until it leaves working: the ttls it reported while working, each checked to put
    its expiry a retention period ahead (less the whole second the age is counted in), and its
    first state after."""
    seen: list[int] = []
    async with asyncio.timeout(30):
        while True:
            asked = datetime.now(UTC)
            task: dict[str, Any] = await read()
            if task["status"] != "working":
                return seen, task
            # (its timestamps are to the millisecond: 10 ms of slack)
            assert expiry(task, ttl_key) >= asked + timedelta(milliseconds=retention_ms - 1_010)
            seen.append(task[ttl_key])
            await asyncio.sleep(0.1)


async def gone_after(read_gone: Any, ended: datetime, retention_ms: int) -> None:
    """The finished task is still there until one retention period after it ended, then gone."""
    async with asyncio.timeout(20):
        while not await read_gone():
            await asyncio.sleep(0.05)
    assert datetime.now(UTC) >= ended + timedelta(milliseconds=retention_ms)


async def test_a_task_outlives_its_first_ttl_and_is_kept_one_retention_after_it_ends_T_TTL_2_4_5(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with serve(make_settings(database_url, min_ttl_ms=200, sweep_interval_ms=100)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        created = (await s.call_tool_as_task("sleep", {"seconds": 2.5}, {"ttl": 1_000}))["task"]
        assert created["ttl"] == 1_000  # what was granted: it was created just now
        task_id = created["taskId"]
        seen, _ = await watch_working(lambda: s.result("tasks/get", {"taskId": task_id}), "ttl", 1_000)
        assert seen == sorted(seen)
        assert seen[-1] >= 2_000  # it grew while the task worked past its first ttl
        result = await s.result("tasks/result", {"taskId": task_id})
        assert not result.get("isError")
        done = await s.result("tasks/get", {"taskId": task_id})
        assert done["status"] == "completed"
        ended = at(done["lastUpdatedAt"])
        # Once ended the ttl stands: createdAt + ttl is the end plus the retention (to the second).
        assert ended < expiry(done, "ttl") <= ended + timedelta(milliseconds=1_000)
        assert (await s.result("tasks/get", {"taskId": task_id}))["ttl"] == done["ttl"]

        async def read_gone() -> bool:
            return "error" in await s.send("tasks/get", {"taskId": task_id})

        await gone_after(read_gone, ended, 1_000)
        assert (await s.error("tasks/result", {"taskId": task_id}))["code"] == -32602


async def test_a_modern_task_outlives_the_default_ttl_and_is_kept_one_retention_after_it_ends_X_TTL_2(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """The client cannot ask for a ttl on this wire (X-TTL-8): the default is the retention."""
    settings = make_settings(database_url, default_ttl_ms=1_000, sweep_interval_ms=100, task_grace_ms=0)
    async with serve(settings) as running:
        m = V2026Client(http, running.url)
        created = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 2.5}})
        assert created["resultType"] == "task"
        task_id = created["taskId"]
        seen, _ = await watch_working(lambda: m.result("tasks/get", {"taskId": task_id}), "ttlMs", 1_000)
        assert seen == sorted(seen)
        assert seen[-1] >= 2_000
        done = await until(lambda: m.result("tasks/get", {"taskId": task_id}), lambda t: t["status"] != "working")
        assert done["status"] == "completed"
        assert not done["result"].get("isError")
        ended = at(done["lastUpdatedAt"])
        assert ended < expiry(done, "ttlMs") <= ended + timedelta(milliseconds=1_000)

        async def read_gone() -> bool:
            return (await m.post("tasks/get", {"taskId": task_id})).json().get("error") is not None

        await gone_after(read_gone, ended, 1_000)


async def test_a_task_over_its_runtime_limit_fails_saying_so_and_frees_its_cap_slot(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """The operator's MCP_TASKS_MAX_RUNTIME_S for a tool that declares none (`hang`), the tool's own
    below it (`bounded`, 1 s); one active task per requestor, so the next create needs the slot."""
    settings = make_settings(database_url, max_runtime_s=1.5, max_active_tasks_per_requestor=1)
    async with serve(settings) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        for tool, limit in (("hang", "1.5 s"), ("bounded", "1 s")):
            task_id = (await s.call_tool_as_task(tool, {}))["task"]["taskId"]
            error = await s.error("tasks/result", {"taskId": task_id})  # waits for the end
            assert error["code"] == -32603
            assert f"runtime limit of tool {tool!r} ({limit}" in error["message"]
            failed = await s.result("tasks/get", {"taskId": task_id})
            assert failed["status"] == "failed"
            assert failed["statusMessage"] == error["message"]
        assert (await s.call_tool_as_task("echo", {"text": "the slot is free"}))["task"]["status"] == "working"


async def test_a_modern_task_over_its_runtime_limit_fails_with_the_limit_in_its_error_and_frees_its_slot(
    database_url: str, http: httpx.AsyncClient
) -> None:
    settings = make_settings(database_url, max_runtime_s=1.0, task_grace_ms=0, max_active_tasks_per_requestor=1)
    async with serve(settings) as running:
        m = V2026Client(http, running.url)
        created = await m.result("tools/call", {"name": "hang", "arguments": {}})
        failed = await until(lambda: m.result("tasks/get", {"taskId": created["taskId"]}),
                             lambda t: t["status"] != "working")  # fmt: skip
        assert failed["status"] == "failed"
        assert "runtime limit of tool 'hang' (1 s" in failed["error"]["message"]
        assert failed["statusMessage"] == failed["error"]["message"]
        again = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 0.5}})
        assert again["resultType"] == "task"  # the one slot was free again


@pytest.mark.parametrize(("after", "how"), [(0.1, "returns anyway"), (30.0, "ignores the cancel")])
async def test_the_runtime_limit_holds_for_a_tool_that_swallows_its_cancel(
    database_url: str, http: httpx.AsyncClient, after: float, how: str
) -> None:
    """`stubborn` catches the cancel and sleeps ``after`` seconds more: it returns a result 0.1 s
    later, or keeps running past the renewal interval it is given to stop (lease 3 s: 0.375 s)."""
    async with serve(make_settings(database_url, max_runtime_s=1.0)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("stubborn", {"seconds": 30, "after": after}))["task"]["taskId"]
        began = asyncio.get_running_loop().time()
        error = await s.error("tasks/result", {"taskId": task_id})
        assert "runtime limit of tool 'stubborn' (1 s" in error["message"], how
        assert asyncio.get_running_loop().time() - began < 10, how
        assert (await s.result("tasks/get", {"taskId": task_id}))["status"] == "failed"


async def test_the_runtime_limit_counts_from_the_first_start_across_a_takeover(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """A rerunnable task a runner started 10 s ago and lost is taken over by a runner whose limit is
    5 s: it fails at once, it does not get 5 s more."""
    async with serve(make_settings(database_url, runner_concurrency=0)) as queued:
        s = RpcSession(http, queued.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("sleep", {"seconds": 3}))["task"]["taskId"]
    conn = await asyncpg.connect(database_url)
    try:
        # As a first run that stopped left it: started 10 s ago, one attempt, handed back.
        await conn.execute("UPDATE tasks SET started_at = now() - interval '10 seconds', attempts = 1 "
                           "WHERE task_id = $1", task_id)  # fmt: skip
    finally:
        await conn.close()
    async with serve(make_settings(database_url, max_runtime_s=5.0)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        began = asyncio.get_running_loop().time()
        error = await s.error("tasks/result", {"taskId": task_id})
        assert "runtime limit of tool 'sleep' (5 s, counted from its first start)" in error["message"]
        assert asyncio.get_running_loop().time() - began < 3  # not the 3 s the tool would sleep


async def test_an_unanswered_question_fails_the_task_after_the_input_timeout_on_both_wires(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with serve(make_settings(database_url, input_timeout_s=0.5, task_grace_ms=0)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        legacy = (await s.call_tool_as_task("confirm", {}))["task"]["taskId"]
        m = V2026Client(http, running.url)
        modern = (await m.result("tools/call", {"name": "slow_confirm", "arguments": {"seconds": 0.1}}))["taskId"]
        await until(lambda: s.result("tasks/get", {"taskId": legacy}), lambda t: t["status"] == "input_required")
        failed = await until(lambda: s.result("tasks/get", {"taskId": legacy}), lambda t: t["status"] == "failed")
        assert failed["statusMessage"].startswith("No answer to the task's question came within 0.5 s")
        modern_failed = await until(lambda: m.result("tasks/get", {"taskId": modern}),
                                    lambda t: t["status"] not in ("working", "input_required"))  # fmt: skip
        assert modern_failed["status"] == "failed"
        assert "MCP_TASKS_INPUT_TIMEOUT_S" in modern_failed["error"]["message"]


def test_a_pack_declaring_a_runtime_above_the_ceiling_is_refused_naming_the_tool_and_the_ceiling() -> None:
    with pytest.raises(ValueError, match=r"tool 'bounded' declares max_runtime_s=1, above the ceiling "
                                         r"MCP_TASKS_MAX_RUNTIME_S=0\.5"):  # fmt: skip
        Registry.load(["tests.toolpack"], max_runtime_s=0.5)
    assert Registry.load(["tests.toolpack"], max_runtime_s=1.0).tools["bounded"].runtime_limit_s(1.0) == 1.0


def test_serve_refuses_such_a_pack_at_start_with_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCP_TASKS_")}
    env.update(MCP_TASKS_TOOLS="service.tools.demo,tests.toolpack", MCP_TASKS_MAX_RUNTIME_S="0.5",
               MCP_TASKS_DATABASE_URL="postgresql://127.0.0.1:1/none")  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "service", "serve"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "tool 'bounded' declares max_runtime_s=1, above the ceiling MCP_TASKS_MAX_RUNTIME_S=0.5" in done.stderr


async def test_a_task_answered_works_on_past_its_ttl_and_its_ttl_stands_while_it_waits(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Waiting for input it is kept its ttl from its last change (the value stands); answered, it
    works again with no expiry, past that ttl, and completes."""
    settings = make_settings(database_url, default_ttl_ms=1_000, sweep_interval_ms=100, task_grace_ms=0)
    async with serve(settings) as running:
        m = V2026Client(http, running.url)
        created = await m.result("tools/call", {"name": "confirm_then_sleep", "arguments": {"seconds": 2.5}})
        task_id = created["taskId"]
        waiting = await until(lambda: m.result("tasks/get", {"taskId": task_id}),
                              lambda t: t["status"] == "input_required")  # fmt: skip
        asked = at(waiting["lastUpdatedAt"])
        assert asked < expiry(waiting, "ttlMs") <= asked + timedelta(milliseconds=1_000)
        [key] = waiting["inputRequests"]
        update = {"taskId": task_id, "inputResponses": {key: {"action": "accept", "content": {"ok": True}}}}
        assert (await m.result("tasks/update", update))["resultType"] == "complete"
        seen, done = await watch_working(lambda: m.result("tasks/get", {"taskId": task_id}), "ttlMs", 1_000)
        assert seen[-1] >= 2_000  # worked past its ttl, counted from creation
        assert done["status"] == "completed"
        assert done["result"]["content"][0]["text"] == "accept then slept 2.5 s"


async def test_a_task_no_runner_starts_is_kept_its_ttl_from_creation_and_reports_it(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Waiting for a runner is not work: a queued task keeps the ttl it was granted, and is gone
    after it (as when no live runner loads its tool), freeing its cap slot."""
    settings = make_settings(database_url, runner_concurrency=0, min_ttl_ms=200, sweep_interval_ms=100)
    async with serve(settings) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        queued = (await s.call_tool_as_task("echo", {"text": "queued"}, {"ttl": 1_000}))["task"]
        seen: list[tuple[str, int]] = []

        async def read_gone() -> bool:
            answer = await s.send("tasks/get", {"taskId": queued["taskId"]})
            if "error" in answer:
                return True
            seen.append((answer["result"]["status"], answer["result"]["ttl"]))
            return False

        await gone_after(read_gone, at(queued["createdAt"]), 1_000)
        assert set(seen) == {("working", 1_000)}  # read for its whole second, never grown


async def test_a_task_a_release_0_1_0_statement_ends_gets_its_retention_from_that_change(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """While 0.1.0 runs beside this release its statements end tasks without setting their expiry
    (its cancel_task, as here): the trigger gives such a row its retention, so none is kept forever."""
    async with serve(make_settings(database_url)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("hang", {}, {"ttl": 60_000}))["task"]["taskId"]
        conn = await asyncpg.connect(database_url)
        try:
            started = await until(lambda: conn.fetchrow("SELECT expires_at = 'infinity' AS unbounded, status::text "
                                                        "FROM tasks WHERE task_id = $1", task_id),
                                  lambda row: row["unbounded"])  # fmt: skip
            assert started["status"] == "working"
            ended = await conn.fetchrow(
                "UPDATE tasks SET status = 'cancelled', status_message = 'cancelled by 0.1.0', "
                "last_updated_at = clock_timestamp(), finished_at = clock_timestamp(), lease_owner = NULL, "
                "lease_expires_at = NULL WHERE task_id = $1 "
                "RETURNING expires_at - last_updated_at AS kept", task_id)  # fmt: skip
        finally:
            await conn.close()
    assert timedelta(seconds=59) < ended["kept"] < timedelta(seconds=61)
