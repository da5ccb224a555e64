"""Upstreams that speak the 2026-07-28 Tasks extension (issue 41, point 4): a call declares the
extension; what the upstream makes a task of its own is followed by its id, kept with ours, and
resumed by the next process after a SIGKILL (the upstream ran it once); questions are relayed both
ways (MRTR before the task, inputRequests/tasks/update within it); our cancel cancels it.

The upstream is this service itself (`serve` in single-user mode on loopback, its own database):
a real 2026-07-28 server with the extension, that speaks 2025-11-25 too (its tools are listed there)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from tests.conftest import RunningServer, free_port, fresh_database, make_settings, serve
from tests.ext import V2026Client
from tests.rpc import RpcSession
from tests.test_durability import ROOT, mcp_tasks
from tests.test_upstreams import server_process, task_outcome, until, upstreams_file


@pytest.fixture
async def upstream_db(admin_dsn: str, template_db: str) -> AsyncIterator[str]:
    async with fresh_database(admin_dsn, template_db) as url:
        yield url


@pytest.fixture
async def upstream(upstream_db: str) -> AsyncIterator[RunningServer]:
    async with serve(make_settings(upstream_db)) as running:
        yield running


def env_for(tmp_path: Path, upstream: RunningServer, **extra: str) -> dict[str, str]:
    body = f'[[upstream]]\nname = "ext"\nurl = "{upstream.url}"\ntools = ["sleep", "confirm", "slow_confirm"]\n'
    return {"MCP_TASKS_UPSTREAMS_FILE": upstreams_file(tmp_path, body), **extra}


async def upstream_tasks(upstream_db: str, tool: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(upstream_db)
    try:
        return await conn.fetch("SELECT wire, status::text, outcome FROM tasks WHERE tool = $1", tool)
    finally:
        await conn.close()


async def test_a_call_becomes_the_upstreams_task_followed_with_its_questions_and_cancelled_with_ours(
    tmp_path: Path, database_url: str, upstream: RunningServer, upstream_db: str, http: httpx.AsyncClient
) -> None:
    async with mcp_tasks("serve", database_url, **env_for(tmp_path, upstream)) as (_proc, mcp):
        s = RpcSession(http, mcp)
        await s.initialize()
        assert {"ext.sleep", "ext.confirm", "ext.slow_confirm"} <= {
            t["name"] for t in (await s.result("tools/list"))["tools"]
        }

        task_id = (await s.call_tool_as_task("ext.sleep", {"seconds": 2.5}))["task"]["taskId"]

        async def relayed() -> bool:  # the upstream task's status message is ours
            return "slept" in ((await s.result("tasks/get", {"taskId": task_id})).get("statusMessage") or "")

        await until(relayed)
        assert (await task_outcome(s, task_id))["status"] == "completed"
        assert (await s.result("tasks/result", {"taskId": task_id}))["content"][0]["text"] == "slept 2.5s"
        rows = await upstream_tasks(upstream_db, "sleep")
        assert [(r["wire"], r["status"]) for r in rows] == [("2026-07-28", "completed")]  # the upstream's own task
        shown = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "service", "upstreams", "--json"], capture_output=True, text=True,
            timeout=60, cwd=ROOT, env={**os.environ, "MCP_TASKS_DATABASE_URL": database_url},
        )  # fmt: skip
        assert orjson.loads(shown.stdout.splitlines()[0])["tasks"] == "2026-07-28", shown.stdout + shown.stderr

        # Asked within the upstream's task: its inputRequests reach our client, the answer goes back
        # with tasks/update.
        c = V2026Client(http, mcp)
        created = await c.result("tools/call", {"name": "ext.slow_confirm", "arguments": {"seconds": 1.0}})
        ours = created["taskId"]

        async def asking() -> dict[str, Any] | None:
            got = await c.result("tasks/get", {"taskId": ours})
            return got if got["status"] == "input_required" else None

        key = next(iter((await until(asking))["inputRequests"]))
        await c.result(
            "tasks/update", {"taskId": ours, "inputResponses": {key: {"action": "accept", "content": {"ok": True}}}}
        )

        async def answered() -> dict[str, Any] | None:
            got = await c.result("tasks/get", {"taskId": ours})
            return got if got["status"] == "completed" else None

        assert (await until(answered))["result"]["content"][0]["text"] == "accept:True"
        assert [r["status"] for r in await upstream_tasks(upstream_db, "slow_confirm")] == ["completed"]

        # Asked before the upstream made up its mind (MRTR): asked of our client as a 2025 task's
        # question, sent again with the answer.
        confirm_id = (await s.call_tool_as_task("ext.confirm", {"prompt": "Ship it?"}))["task"]["taskId"]
        async with asyncio.timeout(20):
            async for msg in s.stream("tasks/result", {"taskId": confirm_id}):
                if msg.get("method") == "elicitation/create":
                    assert msg["params"]["message"] == "Ship it?"
                    await s.reply(msg["id"], {"action": "accept", "content": {"ok": True}})
                elif "result" in msg:
                    assert msg["result"]["content"][0]["text"] == "answer: ok=True"
                    break
        assert await upstream_tasks(upstream_db, "confirm") == []  # answered in its request: no task there

        long_id = (await s.call_tool_as_task("ext.sleep", {"seconds": 120}))["task"]["taskId"]

        async def upstream_working() -> bool:
            return any(r["status"] == "working" for r in await upstream_tasks(upstream_db, "sleep"))

        await until(upstream_working)
        await s.result("tasks/cancel", {"taskId": long_id})

        async def upstream_cancelled() -> bool:
            return "cancelled" in {r["status"] for r in await upstream_tasks(upstream_db, "sleep")}

        await until(upstream_cancelled)


async def test_sigkill_mid_task_follows_the_same_upstream_task_from_the_next_process(
    tmp_path: Path, database_url: str, upstream: RunningServer, upstream_db: str, http: httpx.AsyncClient
) -> None:
    env = env_for(tmp_path, upstream, MCP_TASKS_LEASE_MS="3000")
    async with mcp_tasks("serve", database_url, **env) as (proc, mcp):
        s = RpcSession(http, mcp)
        await s.initialize()
        task_id = (await s.call_tool_as_task("ext.sleep", {"seconds": 5}))["task"]["taskId"]

        async def kept() -> bool:  # the upstream made it a task, and its id is kept with ours
            conn = await asyncpg.connect(database_url)
            try:
                return bool(await conn.fetchval("SELECT count(*) FROM task_notes WHERE note ? 'upstream_task'"))
            finally:
                await conn.close()

        await until(kept)
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
    async with mcp_tasks("serve", database_url, **env) as (_proc, mcp):
        s = RpcSession(http, mcp)
        await s.initialize()
        finished = await task_outcome(s, task_id)
        assert finished["status"] == "completed", finished
        assert (await s.result("tasks/result", {"taskId": task_id}))["content"][0]["text"] == "slept 5s"
    assert [r["status"] for r in await upstream_tasks(upstream_db, "sleep")] == ["completed"]  # run once


async def test_an_upstream_without_the_extension_is_called_as_before(
    tmp_path: Path, database_url: str, http: httpx.AsyncClient
) -> None:
    """The 2025-11-25 upstream of tests/test_upstreams.py answers server/discover with an error: its
    calls stay plain calls (and progress is still relayed)."""
    from tests.test_upstreams import http_upstream

    marks = tmp_path / "marks"
    marks.mkdir()
    with http_upstream(marks) as url:
        body = f'[[upstream]]\nname = "up"\nurl = "{url}"\n'
        async with mcp_tasks("serve", database_url, MCP_TASKS_UPSTREAMS_FILE=upstreams_file(tmp_path, body)) as (
            _p,
            mcp,
        ):
            s = RpcSession(http, mcp)
            await s.initialize()
            params = {"name": "up.sleep", "arguments": {"seconds": 0.5}, "_meta": {"progressToken": "p"}}
            messages = [m async for m in s.stream("tools/call", params)]
            assert any(m.get("method") == "notifications/progress" for m in messages)
            assert messages[-1]["result"]["content"][0]["text"] == "slept 0.5s"


@contextlib.contextmanager
def modern_only_upstream(marks: Path) -> Iterator[str]:
    """tests/modern_only_server.py on a free port: it refuses initialize and speaks 2026-07-28 only."""
    port = free_port()
    with server_process(
        [sys.executable, "-m", "tests.modern_only_server", str(port), "--marks", str(marks)], port
    ) as url:
        yield url


async def test_an_upstream_that_speaks_only_2026_is_listed_and_called_on_that_wire(
    tmp_path: Path, database_url: str, http: httpx.AsyncClient
) -> None:
    """An upstream that refuses our 2025-11-25 session (initialize) but answers 2026-07-28's
    server/discover: its tools are listed on that wire (again when its subscriptions/listen says
    they changed) and its calls made there, from both of our wires; `mcp-tasks upstreams` shows it
    up, with no tasks wire (it offers no Tasks extension)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    with modern_only_upstream(marks) as url:
        body = f'[[upstream]]\nname = "mod"\nurl = "{url}"\n'
        async with mcp_tasks("serve", database_url, MCP_TASKS_UPSTREAMS_FILE=upstreams_file(tmp_path, body)) as (
            _proc,
            mcp,
        ):
            s = RpcSession(http, mcp)
            await s.initialize()

            async def listed() -> bool:
                return "mod.echo" in {t["name"] for t in (await s.result("tools/list"))["tools"]}

            await until(listed)
            task_id = (await s.call_tool_as_task("mod.echo", {"text": "only new"}))["task"]["taskId"]
            assert (await task_outcome(s, task_id))["status"] == "completed"
            assert (await s.result("tasks/result", {"taskId": task_id}))["content"][0]["text"] == "only new"
            plain = V2026Client(http, mcp, capabilities={})  # declares no extension: answered at once
            answer = await plain.result("tools/call", {"name": "mod.echo", "arguments": {"text": "newer"}})
            assert answer["content"][0]["text"] == "newer"
            # Its tools changed: its listen says so, and the new tool is ours long before the
            # periodic listing (60 s) would have found it.
            assert (await plain.result("tools/call", {"name": "mod.grow", "arguments": {}}))["content"]

            async def grown() -> bool:
                return "mod.grown" in {t["name"] for t in (await s.result("tools/list"))["tools"]}

            await until(grown, timeout=15)
            shown = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "service", "upstreams", "--json"], capture_output=True,
                text=True, timeout=60, cwd=ROOT, env={**os.environ, "MCP_TASKS_DATABASE_URL": database_url},
            )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    view = orjson.loads(shown.stdout.splitlines()[0])
    assert (view["upstream"], view["state"], view["tasks"]) == ("mod", "up", None), view
    assert view["tools"] == ["echo", "grow", "grown"]
    requests = [line.split() for line in (marks / "requests").read_text().splitlines()]
    assert [version for method, version in requests if method == "tools/call"] == ["2026-07-28"] * 3
    assert {"initialize", "subscriptions/listen"} <= {method for method, _ in requests}  # initialize refused


async def test_a_2026_only_upstream_that_goes_down_and_comes_back_is_followed_again(
    tmp_path: Path, database_url: str, http: httpx.AsyncClient
) -> None:
    """Down (its ping fails): shown down; back on the same port: up again, its calls made on its wire."""
    marks = tmp_path / "marks"
    marks.mkdir()
    port = free_port()
    argv = [sys.executable, "-m", "tests.modern_only_server", str(port), "--marks", str(marks)]
    body = f'[[upstream]]\nname = "mod"\nurl = "http://127.0.0.1:{port}/mcp"\n'
    env = {"MCP_TASKS_UPSTREAMS_FILE": upstreams_file(tmp_path, body), "MCP_TASKS_DATABASE_URL": database_url}

    async def shown(state: str) -> dict[str, Any] | None:
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "service", "upstreams", "--json"], capture_output=True,
            text=True, timeout=60, cwd=ROOT, env={**os.environ, **env},
        )  # fmt: skip
        live = [r for r in map(orjson.loads, done.stdout.splitlines()) if r["upstream"] == "mod" and r["process"]]
        return live[0] if live and live[0]["state"] == state else None

    async with mcp_tasks("serve", database_url, **env) as (_proc, mcp):
        plain = V2026Client(http, mcp, capabilities={})
        with server_process(argv, port):
            await until(lambda: shown("up"), timeout=30)
            assert (await echoed(plain, "first"))["content"][0]["text"] == "first"
        down = await until(lambda: shown("down"), timeout=30)  # its ping (every 10 s) failed
        assert down["last_error"], down
        with server_process(argv, port):
            await until(lambda: shown("up"), timeout=45)
            assert (await echoed(plain, "back"))["content"][0]["text"] == "back"


async def echoed(plain: V2026Client, text: str) -> dict[str, Any]:
    return await plain.result("tools/call", {"name": "mod.echo", "arguments": {"text": text}})


async def test_credentials_that_cannot_be_read_fail_a_2026_call_with_a_message_naming_the_upstream(
    tmp_path: Path, database_url: str, upstream: RunningServer, http: httpx.AsyncClient
) -> None:
    """Our bearer file for the upstream emptied after the start: the call on 2026-07-28 fails
    saying which upstream and what to fix (it said "failed unexpectedly" with a reference)."""
    token = tmp_path / "token"
    token.write_text("ours\n")
    body = (f'[[upstream]]\nname = "ext"\nurl = "{upstream.url}"\ntools = ["sleep"]\n'
            f'[upstream.auth]\nbearer_file = "{token}"\n')  # fmt: skip
    async with mcp_tasks("serve", database_url, MCP_TASKS_UPSTREAMS_FILE=upstreams_file(tmp_path, body)) as (_p, mcp):
        s = RpcSession(http, mcp)
        await s.initialize()
        first = (await s.call_tool_as_task("ext.sleep", {"seconds": 0.1}))["task"]["taskId"]
        assert (await task_outcome(s, first))["status"] == "completed"
        token.write_text("")
        second = (await s.call_tool_as_task("ext.sleep", {"seconds": 0.1}))["task"]["taskId"]
        failed = await task_outcome(s, second)
        assert failed["status"] == "failed"
        assert "upstream 'ext'" in failed["statusMessage"], failed
        assert f"auth.bearer_file {token} is empty" in failed["statusMessage"], failed
