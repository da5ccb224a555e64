"""Regression tests for defects found in review: each names what once went wrong."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import RunningServer, make_settings, serve
from tests.rpc import ACCEPT_BOTH, RpcSession, sse_messages
from tests.toolpack import signal


@pytest.fixture
async def quick_keepalive(database_url: str) -> Any:
    # No grace: tasks/result on an unfinished task streams at once, so keep-alives pass on it.
    async with serve(make_settings(database_url, sse_keepalive_ms=100, result_grace_ms=0)) as running:
        yield running


async def test_a_keepalive_does_not_end_a_waiting_tasks_result_T_RES_3(
    quick_keepalive: RunningServer, http: httpx.AsyncClient
) -> None:
    s = RpcSession(http, quick_keepalive.url)
    await s.initialize()
    task_id = (await s.call_tool_as_task("sleep", {"seconds": 0.7}))["task"]["taskId"]
    msg = s.message("tasks/result", {"taskId": task_id})
    async with http.stream("POST", s.url, json=msg, headers=s.headers()) as r, asyncio.timeout(10):
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines()]
    assert lines.count(": keepalive") >= 3  # many keep-alives passed while it waited
    final = orjson.loads(next(line for line in reversed(lines) if line.startswith("data:")).removeprefix("data:"))
    assert final["id"] == msg["id"]
    assert final["result"]["content"][0]["text"] == "slept 0.7s"


async def test_a_keepalive_does_not_end_the_get_stream(quick_keepalive: RunningServer, http: httpx.AsyncClient) -> None:
    s = RpcSession(http, quick_keepalive.url)
    await s.initialize()
    async with (
        http.stream("GET", s.url, headers={**s.headers(), "Accept": "text/event-stream"}) as r,
        asyncio.timeout(10),
    ):
        lines = r.aiter_lines()
        keepalives = 0
        while keepalives < 3:  # several keep-alive periods with nothing to say
            line = await anext(lines, None)
            assert line is not None, "the GET stream ended during its keep-alives"
            keepalives += line == ": keepalive"
        task_id = (await s.call_tool_as_task("echo", {"text": "x"}))["task"]["taskId"]
        async for line in lines:
            if line.startswith("data:"):
                msg = orjson.loads(line.removeprefix("data:"))
                if msg.get("method") == "notifications/tasks/status" and msg["params"]["taskId"] == task_id:
                    break
        else:
            raise AssertionError("the GET stream ended before the task's status notification")


@pytest.fixture
def server(tenant_server: RunningServer) -> RunningServer:
    """The module's shared server (hosted mode), as a tenant of this test's own."""
    return tenant_server


@pytest.fixture
async def s(server: RunningServer, http: httpx.AsyncClient) -> RpcSession:
    session = RpcSession(http, server.url, token=server.token)
    await session.initialize()
    return session


@pytest.mark.parametrize(
    "headers",
    [{"Host": "["}, {"Host": "[::1"}, {"Origin": "http://["}, {"Origin": "http://[zz]"}],
    ids=["host-bracket", "host-open-ipv6", "origin-bracket", "origin-bad-ipv6"],
)
async def test_malformed_host_or_origin_is_403_not_500(
    s: RpcSession, http: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    r = await http.post(s.url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=s.headers(**headers))
    assert r.status_code == 403


async def test_nul_in_arguments_is_invalid_params_and_creates_nothing(s: RpcSession) -> None:
    error = await s.error("tools/call", {"name": "echo", "arguments": {"text": "a\x00b"}, "task": {}})
    assert error["code"] == -32602
    assert (await s.error("tasks/get", {"taskId": "x\x00y"}))["code"] == -32602
    assert (await s.result("tasks/list"))["tasks"] == []


async def test_nul_in_a_client_response_is_400(s: RpcSession, http: httpx.AsyncClient) -> None:
    r = await http.post(s.url, json={"jsonrpc": "2.0", "id": "x", "result": {"v": "\x00"}}, headers=s.headers())
    assert r.status_code == 400


async def test_tool_output_with_nul_is_stored_not_lost(s: RpcSession) -> None:
    task_id = (await s.call_tool_as_task("nul_output", {}))["task"]["taskId"]
    result = await s.result("tasks/result", {"taskId": task_id})
    assert result["content"][0]["text"] == "before\ufffdafter"


async def test_a_plain_call_that_streams_then_fails_still_answers_with_its_error(s: RpcSession) -> None:
    messages = [m async for m in s.stream("tools/call", {"name": "log_then_crash", "arguments": {}})]
    assert messages[0]["method"] == "notifications/message"
    assert messages[-1]["error"] == {"code": -32001, "message": "failed after talking"}


async def test_cancelled_task_stays_cancelled_when_its_work_finishes_anyway_T_CANCEL_6(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with serve(make_settings(database_url)) as running:  # its own runner, to see it go idle
        runner = running.app.state.core.runner
        s = RpcSession(http, running.url)
        await s.initialize()
        key = secrets.token_hex(4)
        task_id = (await s.call_tool_as_task("stubborn", {"seconds": 0.2, "key": key}))["task"]["taskId"]
        async with asyncio.timeout(10):
            await signal(key, "started").wait()
            assert (await s.result("tasks/cancel", {"taskId": task_id}))["status"] == "cancelled"
            await signal(key, "cancelled").wait()  # the cancel reached the tool, which ignores it
            await signal(key, "returned").wait()
            while runner.busy:  # the runner has offered the late outcome and been refused
                await asyncio.sleep(0.01)
        assert (await s.result("tasks/get", {"taskId": task_id}))["status"] == "cancelled"
        assert (await s.error("tasks/result", {"taskId": task_id}))["data"]["status"] == "cancelled"


async def until_in_flight(server: RunningServer, s: RpcSession, request_id: Any) -> None:
    """Until this server holds the request among those notifications/cancelled can stop."""
    calls = server.app.state.mcp.v2025.surface.inflight.calls  # keys: (tenant, session, repr(request id))
    async with asyncio.timeout(10):
        while not any(key[1:] == (s.session_id, repr(request_id)) for key in calls):
            await asyncio.sleep(0.01)


async def test_notifications_cancelled_ends_a_blocking_tasks_result_but_not_the_task_C_9(
    server: RunningServer, s: RpcSession, http: httpx.AsyncClient
) -> None:
    task_id = (await s.call_tool_as_task("sleep", {"seconds": 1.0}))["task"]["taskId"]
    msg = s.message("tasks/result", {"taskId": task_id})

    async def wait() -> list[dict[str, Any]]:
        async with http.stream("POST", s.url, json=msg, headers=s.headers()) as r:
            if r.headers["content-type"].startswith("application/json"):  # the answer came after all
                return [orjson.loads(await r.aread())]
            return [m async for m in sse_messages(r)]

    waiter = asyncio.create_task(wait())
    await until_in_flight(server, s, msg["id"])
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": msg["id"]}}
    assert (await http.post(s.url, json=cancel, headers=s.headers())).status_code == 202
    async with asyncio.timeout(5):
        messages = await waiter
    assert not any("result" in m or "error" in m for m in messages)
    result = await s.result("tasks/result", {"taskId": task_id})
    assert result["content"][0]["text"] == "slept 1s"


async def test_form_elicitation_needs_form_support_T_CAP_8(server: RunningServer, http: httpx.AsyncClient) -> None:
    s = RpcSession(http, server.url, token=server.token)
    await s.initialize(capabilities={"elicitation": {"url": {}}})
    task_id = (await s.call_tool_as_task("confirm", {}))["task"]["taskId"]
    result = await s.result("tasks/result", {"taskId": task_id})
    assert result["isError"] is True
    assert "form elicitation" in result["content"][0]["text"]


async def test_unexpected_tool_exception_does_not_leak_details(s: RpcSession) -> None:
    error = await s.error("tools/call", {"name": "leaky", "arguments": {}})
    assert error["code"] == -32603
    assert "hunter2" not in error["message"]
    assert "reference" in error["message"]
    task_id = (await s.call_tool_as_task("leaky", {}))["task"]["taskId"]
    assert "hunter2" not in (await s.error("tasks/result", {"taskId": task_id}))["message"]
    assert "hunter2" not in (await s.result("tasks/get", {"taskId": task_id}))["statusMessage"]


@pytest.mark.parametrize("seconds", ["NaN", "Infinity", -1, 1e9])
async def test_sleep_refuses_non_finite_or_out_of_range_seconds(s: RpcSession, seconds: Any) -> None:
    result = await s.result("tools/call", {"name": "sleep", "arguments": {"seconds": seconds}})
    assert result["isError"] is True


async def test_accept_with_wildcards_counts(s: RpcSession, http: httpx.AsyncClient) -> None:
    r = await http.post(s.url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=s.headers(Accept="*/*"))
    assert r.status_code == 200
    assert ACCEPT_BOTH  # the default clients send both types explicitly


async def test_nul_in_a_progress_token_is_refused_before_the_database_but_a_literal_backslash_u0000_is_text(
    s: RpcSession,
) -> None:
    params = {"name": "echo", "arguments": {"text": "x"}, "task": {}, "_meta": {"progressToken": "a\x00"}}
    assert (await s.error("tools/call", params))["code"] == -32602
    assert (await s.result("tasks/list"))["tasks"] == []
    created = await s.call_tool_as_task("echo", {"text": "\\u0000"})  # six characters, no NUL
    result = await s.result("tasks/result", {"taskId": created["task"]["taskId"]})
    assert result["content"][0]["text"] == "\\u0000"
