"""Upstreams with tasks of their own (issue 41, point 4): the upstream task is created once, its id
kept with ours, followed, resumed by the next process after a SIGKILL (the upstream tool runs once),
cancelled with ours; one the upstream binds to the MCP session cannot be resumed, and says so.
The upstream is tests/upstream_tasks_server.py (the official SDK's low-level server)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.ext import V2026Client
from tests.rpc import RpcSession
from tests.test_durability import mcp_tasks
from tests.test_upstreams import server_process, task_outcome, until, upstreams_file


@contextlib.contextmanager
def task_upstream(marks: Path, *flags: str) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "tests.upstream_tasks_server", str(port), "--marks", str(marks), *flags]
    with server_process(argv, port) as url:
        yield url


@pytest.fixture
def marks(tmp_path: Path) -> Path:
    path = tmp_path / "marks"
    path.mkdir()
    return path


def env_for(tmp_path: Path, url: str) -> dict[str, str]:
    body = f'[[upstream]]\nname = "tup"\nurl = "{url}"\n[upstream.auth]\nbearer_env = "TUP_TOKEN"\n'
    return {"MCP_TASKS_UPSTREAMS_FILE": upstreams_file(tmp_path, body), "MCP_TASKS_LEASE_MS": "3000",
            "TUP_TOKEN": "ours"}  # fmt: skip


def started(marks: Path) -> int:
    return len(list(marks.glob("work-*.started")))


async def test_an_upstream_task_is_followed_on_both_wires_and_cancelled_with_ours(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    with task_upstream(marks) as url:
        async with mcp_tasks("serve", database_url, **env_for(tmp_path, url)) as (_proc, mcp):
            s = RpcSession(http, mcp)
            await s.initialize()
            tools = {t["name"]: t for t in (await s.result("tools/list"))["tools"]}
            assert "tup.work" in tools
            task_id = (await s.call_tool_as_task("tup.work", {"seconds": 1}))["task"]["taskId"]

            async def stepping() -> bool:  # the upstream task's status message, relayed
                return "step" in ((await s.result("tasks/get", {"taskId": task_id})).get("statusMessage") or "")

            await until(stepping)
            assert (await task_outcome(s, task_id))["status"] == "completed"
            result = await s.result("tasks/result", {"taskId": task_id})
            assert result["content"][0]["text"] == "worked 1s"

            c = V2026Client(http, mcp)
            created = await c.result("tools/call", {"name": "tup.work", "arguments": {"seconds": 0.6}})
            ext_id = created["task"]["taskId"] if "task" in created else created["taskId"]

            async def done() -> dict[str, Any] | None:
                got = await c.result("tasks/get", {"taskId": ext_id})
                return got if got["status"] == "completed" else None

            assert (await until(done))["result"]["content"][0]["text"] == "worked 0.6s"
            assert started(marks) == 2

            long_id = (await s.call_tool_as_task("tup.work", {"seconds": 60}))["task"]["taskId"]
            await until(lambda: _at_least(marks, 3))
            await s.result("tasks/cancel", {"taskId": long_id})
            await until(lambda: _cancelled(marks))  # the upstream's task was cancelled too


async def test_sigkill_mid_task_resumes_the_same_upstream_task_in_the_next_process_which_runs_once(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    with task_upstream(marks) as url:
        env = env_for(tmp_path, url)
        async with mcp_tasks("serve", database_url, **env) as (proc, mcp):
            s = RpcSession(http, mcp)
            await s.initialize()
            task_id = (await s.call_tool_as_task("tup.work", {"seconds": 5}))["task"]["taskId"]
            await until(lambda: _at_least(marks, 1))
            await asyncio.sleep(0.5)  # its id is kept with ours
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
        async with mcp_tasks("serve", database_url, **env) as (_proc, mcp):
            s = RpcSession(http, mcp)
            await s.initialize()
            finished = await task_outcome(s, task_id)
            assert finished["status"] == "completed", finished
            assert (await s.result("tasks/result", {"taskId": task_id}))["content"][0]["text"] == "worked 5s"
            assert started(marks) == 1  # followed again, never called again


async def test_a_session_bound_upstream_task_cannot_be_resumed_and_the_task_says_so(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    with task_upstream(marks, "--session-bound") as url:
        env = env_for(tmp_path, url)
        async with mcp_tasks("serve", database_url, **env) as (proc, mcp):
            s = RpcSession(http, mcp)
            await s.initialize()
            task_id = (await s.call_tool_as_task("tup.work", {"seconds": 30}))["task"]["taskId"]
            await until(lambda: _at_least(marks, 1))
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
        async with mcp_tasks("serve", database_url, **env) as (_proc, mcp):
            s = RpcSession(http, mcp)
            await s.initialize()
            failed = await task_outcome(s, task_id)
            assert failed["status"] == "failed"
            assert "cannot be reached from another session" in failed["statusMessage"]
            assert started(marks) == 1


async def test_an_upstream_task_past_timeout_s_fails_once_and_counts_not_against_the_upstream(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    """timeout_s is the call's bound, not the upstream's failure (as for a plain call): a
    rerunnable upstream's task is not followed again, and its circuit stays closed."""
    with task_upstream(marks) as url:
        body = (f'[[upstream]]\nname = "tup"\nurl = "{url}"\ntimeout_s = 1\nrerunnable = true\n'
                'circuit_failures = 1\n[upstream.auth]\nbearer_env = "TUP_TOKEN"\n')  # fmt: skip
        env = {"MCP_TASKS_UPSTREAMS_FILE": upstreams_file(tmp_path, body), "TUP_TOKEN": "ours"}
        async with mcp_tasks("serve", database_url, **env) as (_proc, mcp):
            s = RpcSession(http, mcp)
            await s.initialize()
            slow = (await s.call_tool_as_task("tup.work", {"seconds": 30}))["task"]["taskId"]
            failed = await task_outcome(s, slow)
            assert failed["status"] == "failed"
            assert "did not answer within timeout_s=1 s" in failed["statusMessage"]
            assert "tried" not in failed["statusMessage"]
            await until(lambda: _cancelled(marks))  # the upstream's task was cancelled with ours
            quick = (await s.call_tool_as_task("tup.work", {"seconds": 0.2}))["task"]["taskId"]
            done = await task_outcome(s, quick)
            assert done["status"] == "completed", done  # not refused by an open circuit


async def test_a_reused_session_a_task_upstream_dropped_is_replaced_without_failing_the_task(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    """As for a plain call: the upstream restarted between two calls no longer knows our idle
    session (404); the task is created again on a new session, since the old one never reached it."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.upstream_tasks_server", str(port), "--marks", str(marks)]
    env = env_for(tmp_path, f"http://127.0.0.1:{port}/mcp")
    async with mcp_tasks("serve", database_url, MCP_TASKS_UPSTREAM_DOWN_GRACE_S="3600", **env) as (_proc, mcp):
        s = RpcSession(http, mcp)
        await s.initialize()
        for seconds in (0.2, 0.4):
            with server_process(argv, port):  # a new process each time: our idle session is unknown there
                await until(lambda: _listed(s))
                task_id = (await s.call_tool_as_task("tup.work", {"seconds": seconds}))["task"]["taskId"]
                done = await task_outcome(s, task_id)
                assert done["status"] == "completed", done.get("statusMessage")
                assert (await s.result("tasks/result", {"taskId": task_id}))["content"][0][
                    "text"
                ] == f"worked {seconds}s"


async def _listed(s: RpcSession) -> bool:
    return "tup.work" in {t["name"] for t in (await s.result("tools/list"))["tools"]}


async def _at_least(marks: Path, n: int) -> bool:
    return started(marks) >= n


async def _cancelled(marks: Path) -> bool:
    return any(marks.glob("work-*.cancelled"))
