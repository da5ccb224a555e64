"""The 2025-11-25 Tasks lifecycle against a real server and database (spec/TASKS-REQUIREMENTS.md)."""

from __future__ import annotations

import asyncio
import json
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import jsonschema
import pytest
from prometheus_client import REGISTRY as METRICS

from service.config import LOCAL_DEFAULT_TTL_MS, LOCAL_MAX_TTL_MS
from tests.conftest import RunningServer, make_settings, serve
from tests.rpc import RpcSession
from tests.toolpack import signal

SCHEMA = json.loads((Path(__file__).parent / "schemas" / "schema-2025-11-25.json").read_text())
RELATED = "io.modelcontextprotocol/related-task"


def assert_schema(instance: Any, type_name: str) -> None:
    jsonschema.validate(
        instance, {"$ref": f"#/$defs/{type_name}", "$defs": SCHEMA["$defs"]}, cls=jsonschema.Draft202012Validator
    )


async def wait_status(s: RpcSession, task_id: str, *statuses: str, timeout: float = 20) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            task = await s.result("tasks/get", {"taskId": task_id})
            if task["status"] in statuses:
                return task
            await asyncio.sleep(0.05)


@pytest.fixture
def server(tenant_server: RunningServer) -> RunningServer:
    """The module's shared server (hosted mode), as a tenant of this test's own."""
    return tenant_server


@pytest.fixture
async def s(server: RunningServer, http: httpx.AsyncClient) -> RpcSession:
    session = RpcSession(http, server.url, token=server.token)
    await session.initialize()
    return session


async def test_initialize_advertises_tasks_capability_T_CAP_1_2_3(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    result = await RpcSession(http, server.url, token=server.token).initialize()
    assert_schema(result, "InitializeResult")
    assert result["protocolVersion"] == "2025-11-25"
    assert result["capabilities"]["tasks"] == {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}


async def test_tools_list_carries_task_support_T_TOOL_1(s: RpcSession) -> None:
    result = await s.result("tools/list")
    assert_schema(result, "ListToolsResult")
    support = {t["name"]: t["execution"]["taskSupport"] for t in result["tools"]}
    assert support["sleep"] == "optional"
    assert support["quick"] == "forbidden"
    assert support["batch"] == "required"


async def test_task_augmented_call_returns_working_task_at_once_T_CREATE_2_5_6_8(s: RpcSession) -> None:
    created = await s.call_tool_as_task("sleep", {"seconds": 5}, {"ttl": 60_000})
    assert_schema(created, "CreateTaskResult")
    task = created["task"]
    assert task["status"] == "working"
    assert task["ttl"] == 60_000
    assert task["pollInterval"] == 100
    assert len(task["taskId"]) >= 43  # 256 random bits, URL-safe (T-SEC-3)
    assert datetime.fromisoformat(task["createdAt"]) <= datetime.fromisoformat(task["lastUpdatedAt"])
    assert created["_meta"][RELATED] == {"taskId": task["taskId"]}  # D-5


async def test_completed_task_result_is_the_tool_result_with_related_task_T_RES_2_5(s: RpcSession) -> None:
    task_id = (await s.call_tool_as_task("echo", {"text": "hi"}))["task"]["taskId"]
    done = await wait_status(s, task_id, "completed")
    assert_schema(done, "GetTaskResult")
    result = await s.result("tasks/result", {"taskId": task_id})
    assert result["content"] == [{"type": "text", "text": "hi"}]
    assert result["_meta"][RELATED] == {"taskId": task_id}
    assert "isError" not in result


async def test_tasks_result_blocks_until_the_task_is_terminal_T_RES_3(s: RpcSession) -> None:
    task_id = (await s.call_tool_as_task("sleep", {"seconds": 0.6}))["task"]["taskId"]
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await s.result("tasks/result", {"taskId": task_id})
    assert loop.time() - started >= 0.4
    assert result["content"][0]["text"] == "slept 0.6s"
    assert (await s.result("tasks/get", {"taskId": task_id}))["status"] == "completed"


async def test_tool_error_fails_the_task_and_result_returns_is_error_T_STATE_7_T_RES_6_T_GET_5(s: RpcSession) -> None:
    task_id = (await s.call_tool_as_task("fail", {"message": "disk full"}))["task"]["taskId"]
    task = await wait_status(s, task_id, "failed", "completed")
    assert task["status"] == "failed"
    assert task["statusMessage"] == "disk full"
    result = await s.result("tasks/result", {"taskId": task_id})
    assert result["isError"] is True
    assert result["content"][0]["text"] == "disk full"


async def test_protocol_error_outcome_is_replayed_by_tasks_result_T_RES_4(s: RpcSession) -> None:
    task_id = (await s.call_tool_as_task("crash", {"message": "exploded"}))["task"]["taskId"]
    await wait_status(s, task_id, "failed")
    error = await s.error("tasks/result", {"taskId": task_id})
    assert error == {"code": -32603, "message": "exploded"}


async def test_cancel_moves_to_cancelled_before_answering_and_stays_T_CANCEL_5_6(s: RpcSession) -> None:
    key = secrets.token_hex(4)
    task_id = (await s.call_tool_as_task("hang", {"key": key}))["task"]["taskId"]
    async with asyncio.timeout(10):
        await signal(key, "started").wait()  # the tool is running
    cancelled = await s.result("tasks/cancel", {"taskId": task_id})
    assert_schema(cancelled, "CancelTaskResult")
    assert cancelled["status"] == "cancelled"
    async with asyncio.timeout(10):
        await signal(key, "cancelled").wait()  # and has been stopped
    assert (await s.result("tasks/get", {"taskId": task_id}))["status"] == "cancelled"


async def test_cancel_of_terminal_task_is_invalid_params_T_CANCEL_2(s: RpcSession) -> None:
    task_id = (await s.call_tool_as_task("echo", {"text": "x"}))["task"]["taskId"]
    await wait_status(s, task_id, "completed")
    error = await s.error("tasks/cancel", {"taskId": task_id})
    assert error["code"] == -32602
    assert error["data"]["status"] == "completed"


async def test_cancel_releases_a_blocked_tasks_result_with_cancelled_error_T_CANCEL_10_D_1(s: RpcSession) -> None:
    key = secrets.token_hex(4)
    task_id = (await s.call_tool_as_task("hang", {"key": key}))["task"]["taskId"]
    async with asyncio.timeout(10):
        await signal(key, "started").wait()
    waiter = asyncio.create_task(s.send("tasks/result", {"taskId": task_id}))
    done, _ = await asyncio.wait({waiter}, timeout=0.3)
    assert not done, "tasks/result answered while the task was still running"
    await s.result("tasks/cancel", {"taskId": task_id})
    async with asyncio.timeout(10):
        response = await waiter
    assert response["error"]["code"] == -32602
    assert response["error"]["data"] == {"taskId": task_id, "status": "cancelled"}


async def test_unknown_task_id_is_invalid_params_everywhere_T_GET_2_T_RES_7_T_CANCEL_3(s: RpcSession) -> None:
    for method in ("tasks/get", "tasks/result", "tasks/cancel"):
        error = await s.error(method, {"taskId": "no-such-task"})
        assert error["code"] == -32602, method


@pytest.mark.parametrize(
    "params",
    [{}, {"taskId": 7}, {"taskId": None}, {"taskId": ["a"]}],
    ids=["missing", "integer", "null", "array"],
)
async def test_bad_task_id_params_are_invalid_params(s: RpcSession, params: dict[str, Any]) -> None:
    assert (await s.error("tasks/get", params))["code"] == -32602


async def test_list_pages_with_opaque_cursor_newest_first_T_LIST_2_3(s: RpcSession) -> None:
    created = [(await s.call_tool_as_task("echo", {"text": str(i)}))["task"]["taskId"] for i in range(55)]
    first = await s.result("tasks/list")
    assert_schema(first, "ListTasksResult")
    assert len(first["tasks"]) == 50
    second = await s.result("tasks/list", {"cursor": first["nextCursor"]})
    assert "nextCursor" not in second
    listed = [t["taskId"] for t in first["tasks"] + second["tasks"]]
    assert listed == list(reversed(created))


async def test_tampered_cursor_is_invalid_params_T_LIST_5(s: RpcSession) -> None:
    for i in range(51):
        await s.call_tool_as_task("echo", {"text": str(i)})
    cursor = (await s.result("tasks/list"))["nextCursor"]
    forged = cursor[:-2] + ("A" if cursor[-2] != "A" else "B") + cursor[-1]
    for bad in (forged, "not-a-cursor", ""):
        assert (await s.error("tasks/list", {"cursor": bad}))["code"] == -32602


async def test_ttl_is_clamped_to_the_maximum_and_defaulted_T_CREATE_7_T_TTL_7(
    database_url: str, http: httpx.AsyncClient
) -> None:
    # Single-user mode's shorter limits (docs/decisions.md); hosted mode uses 1 h / 24 h.
    async with serve(make_settings(database_url)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        huge = await s.call_tool_as_task("echo", {"text": "x"}, {"ttl": 10**12})
        assert huge["task"]["ttl"] == LOCAL_MAX_TTL_MS
        default = await s.call_tool_as_task("echo", {"text": "x"}, {})
        assert default["task"]["ttl"] == LOCAL_DEFAULT_TTL_MS
        tiny = await s.call_tool_as_task("echo", {"text": "x"}, {"ttl": 0})
        assert tiny["task"]["ttl"] == 1_000


@pytest.mark.parametrize("task", [{"ttl": -1}, {"ttl": 1.5}, {"ttl": "60"}, {"ttl": True}, "soon", 5])
async def test_invalid_ttl_is_invalid_params_and_creates_nothing_D_14(s: RpcSession, task: Any) -> None:
    error = await s.error("tools/call", {"name": "echo", "arguments": {"text": "x"}, "task": task})
    assert error["code"] == -32602
    assert (await s.result("tasks/list"))["tasks"] == []


async def test_task_augmented_call_to_forbidden_tool_is_method_not_found_T_TOOL_3(s: RpcSession) -> None:
    error = await s.error("tools/call", {"name": "quick", "arguments": {}, "task": {}})
    assert error["code"] == -32601


async def test_plain_call_to_required_tool_is_method_not_found_T_TOOL_5_D_3(s: RpcSession) -> None:
    error = await s.error("tools/call", {"name": "batch", "arguments": {}})
    assert error["code"] == -32601


async def test_unknown_tool_or_bad_arguments_are_invalid_params_without_a_task_T_TOOL_6(s: RpcSession) -> None:
    assert (await s.error("tools/call", {"name": "nope", "arguments": {}, "task": {}}))["code"] == -32602
    error = await s.error("tools/call", {"name": "sleep", "arguments": {"seconds": "long"}, "task": {}})
    assert error["code"] == -32602
    assert "seconds" in error["message"]
    assert (await s.error("tools/call", {"name": "echo", "arguments": {}, "task": {}}))["code"] == -32602
    assert (await s.result("tasks/list"))["tasks"] == []


async def test_plain_call_returns_the_call_tool_result(s: RpcSession) -> None:
    result = await s.result("tools/call", {"name": "echo", "arguments": {"text": "plain"}})
    assert_schema(result, "CallToolResult")
    assert result["content"] == [{"type": "text", "text": "plain"}]
    assert s.last_content_type.startswith("application/json")


async def test_older_protocol_gets_plain_calls_and_no_task_methods_T_CAP_5_H_VER_4(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    old = RpcSession(http, server.url, token=server.token)
    init = await old.initialize("2025-06-18")
    assert init["protocolVersion"] == "2025-06-18"
    assert "tasks" not in init["capabilities"]
    tools = (await old.result("tools/list"))["tools"]
    assert all("execution" not in t for t in tools)
    result = await old.result("tools/call", {"name": "echo", "arguments": {"text": "old"}, "task": {"ttl": 1000}})
    assert result["content"][0]["text"] == "old"
    assert (await old.error("tasks/list"))["code"] == -32601


async def test_unsupported_requested_version_gets_our_latest_T_CAP_10(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    assert (await RpcSession(http, server.url, token=server.token).initialize("2099-01-01"))[
        "protocolVersion"
    ] == "2025-11-25"


async def test_input_required_elicitation_is_delivered_on_tasks_result_stream_T_INPUT_1_2_3_5_6(s: RpcSession) -> None:
    task_id = (await s.call_tool_as_task("confirm", {"prompt": "Deploy?"}))["task"]["taskId"]
    waiting = await wait_status(s, task_id, "input_required")
    assert waiting["status"] == "input_required"
    seen: list[dict[str, Any]] = []
    async for msg in s.stream("tasks/result", {"taskId": task_id}):
        seen.append(msg)
        if msg.get("method") == "elicitation/create":
            assert_schema(msg, "ElicitRequest")
            assert msg["params"]["_meta"][RELATED] == {"taskId": task_id}
            assert msg["params"]["message"] == "Deploy?"
            reply = await s.reply(msg["id"], {"action": "accept", "content": {"ok": True}})
            assert reply.status_code == 202
    assert s.last_content_type.startswith("text/event-stream")
    final = seen[-1]
    assert final["result"]["content"][0]["text"] == "answer: ok=True"
    # T-NOTIF-2: status notifications are optional and may skip fast transitions; those sent must be valid.
    for note in (m for m in seen if m.get("method") == "notifications/tasks/status"):
        assert_schema(note, "TaskStatusNotification")
    assert (await s.result("tasks/get", {"taskId": task_id}))["status"] == "completed"


async def test_elicitation_without_client_capability_fails_the_task_with_a_tool_error_D_6(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    s = RpcSession(http, server.url, token=server.token)
    await s.initialize(capabilities={})
    task_id = (await s.call_tool_as_task("confirm", {}))["task"]["taskId"]
    result = await s.result("tasks/result", {"taskId": task_id})
    assert result["isError"] is True
    assert "elicitation" in result["content"][0]["text"]


async def test_a_task_run_where_it_was_created_takes_the_sessions_capabilities_from_the_create(
    server: RunningServer, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15: a session's task created under a local runner slot gets what the client declared
    from the creating request, not by reading the session row again (one query per lifecycle);
    the elicitation still reaches the client (and D-6 above: none declared, none asked)."""
    runner = server.app.state.core.runner
    reads: list[str] = []
    read = runner.store.session_capabilities

    async def counting(tenant_id: str, session_id: str) -> dict[str, Any]:
        reads.append(session_id)
        return dict(await read(tenant_id, session_id))

    monkeypatch.setattr(runner.store, "session_capabilities", counting)
    s = RpcSession(http, server.url, token=server.token)
    await s.initialize()
    task_id = (await s.call_tool_as_task("confirm", {"prompt": "Go?"}))["task"]["taskId"]
    assert (await wait_status(s, task_id, "input_required"))["status"] == "input_required"
    await s.result("tasks/cancel", {"taskId": task_id})
    assert reads == []


async def test_a_blocking_tasks_result_reads_the_task_once_before_it_ends_and_once_after_T_RES_3(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 15: the stream of a tasks/result goes on from the request's own read (its watch is
    opened before it), not from a second read; once done, nothing of it stays subscribed. Reads
    are counted as the retrieve statements' items; the poll is a minute away (no re-read but on
    an event)."""

    def retrieves() -> float:
        return METRICS.get_sample_value("mcp_tasks_db_batch_items_sum", {"batch": "retrieve"}) or 0.0

    async with serve(make_settings(database_url, poll_interval_ms=60_000)) as server:
        s = RpcSession(http, server.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("sleep", {"seconds": 0.4}))["task"]["taskId"]
        before = retrieves()
        result = await s.result("tasks/result", {"taskId": task_id})
        assert result["content"][0]["text"] == "slept 0.4s"
        assert retrieves() - before == 2  # working, then completed (after its event)
        assert server.app.state.core.hub.subscribers(("task", "local", task_id)) == 0


async def test_progress_uses_the_creating_token_for_the_task_life_T_PROG_1_3_6(s: RpcSession) -> None:
    created = await s.call_tool_as_task("count", {"n": 4, "interval_ms": 150}, _meta={"progressToken": "p-1"})
    task_id = created["task"]["taskId"]
    progress = [
        m["params"]
        async for m in s.stream("tasks/result", {"taskId": task_id})
        if m.get("method") == "notifications/progress"
    ]
    assert progress, "no progress notifications on the tasks/result stream"
    assert all(p["progressToken"] == "p-1" and p["_meta"][RELATED] == {"taskId": task_id} for p in progress)
    values = [p["progress"] for p in progress]
    assert values == sorted(set(values))
    assert values[-1] <= 4


async def test_task_outlives_its_session_and_is_reachable_from_a_new_one_H_SESS_8(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    first = RpcSession(http, server.url, token=server.token)
    await first.initialize()
    task_id = (await first.call_tool_as_task("echo", {"text": "still here"}))["task"]["taskId"]
    r = await http.delete(server.url, headers=first.headers())
    assert r.status_code == 200
    second = RpcSession(http, server.url, token=server.token)
    await second.initialize()
    result = await second.result("tasks/result", {"taskId": task_id})
    assert result["content"][0]["text"] == "still here"


async def test_expired_task_is_gone_T_TTL_5(database_url: str, http: httpx.AsyncClient) -> None:
    async with serve(make_settings(database_url, min_ttl_ms=200, default_ttl_ms=1000)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("echo", {"text": "brief"}, {"ttl": 300}))["task"]["taskId"]
        async with asyncio.timeout(10):
            while "error" not in await s.send("tasks/get", {"taskId": task_id}):
                await asyncio.sleep(0.05)
        assert (await s.error("tasks/result", {"taskId": task_id}))["code"] == -32602
        assert (await s.result("tasks/list"))["tasks"] == []


async def test_cancel_voids_an_unanswered_elicitation_on_the_stream_C_10(
    s: RpcSession, http: httpx.AsyncClient
) -> None:
    task_id = (await s.call_tool_as_task("confirm", {}))["task"]["taskId"]
    await wait_status(s, task_id, "input_required")
    seen: list[dict[str, Any]] = []
    other = RpcSession(http, s.url, token=s.token)
    other.session_id, other.version = s.session_id, s.version
    async for msg in s.stream("tasks/result", {"taskId": task_id}):
        seen.append(msg)
        if msg.get("method") == "elicitation/create":
            await other.result("tasks/cancel", {"taskId": task_id})  # instead of answering
    request_id = next(m["id"] for m in seen if m.get("method") == "elicitation/create")
    voided = [m["params"] for m in seen if m.get("method") == "notifications/cancelled"]
    assert voided == [{"requestId": request_id, "reason": "task cancelled", "_meta": {RELATED: {"taskId": task_id}}}]
    assert seen[-1]["error"]["data"] == {"taskId": task_id, "status": "cancelled"}


async def test_an_unanswered_elicitation_is_offered_again_to_the_next_stream_D_7(s: RpcSession) -> None:
    task_id = (await s.call_tool_as_task("confirm", {"prompt": "again?"}))["task"]["taskId"]
    await wait_status(s, task_id, "input_required")
    first_ids = []
    async for msg in s.stream("tasks/result", {"taskId": task_id}):
        if msg.get("method") == "elicitation/create":
            first_ids.append(msg["id"])
            break  # the client drops the stream without answering
    async for msg in s.stream("tasks/result", {"taskId": task_id}):
        if msg.get("method") == "elicitation/create":
            assert msg["id"] == first_ids[0]
            await s.reply(msg["id"], {"action": "decline"})
        final = msg
    assert final["result"]["content"][0]["text"] == "action=decline"


async def test_tasks_result_answers_json_when_the_task_ends_with_nothing_to_stream_T_RES_3(s: RpcSession) -> None:
    """Streamable HTTP lets the server pick JSON or SSE: a task that ends within the grace period
    without notices is answered as JSON, like a plain call that says nothing before its result."""
    task_id = (await s.call_tool_as_task("sleep", {"seconds": 0.3}))["task"]["taskId"]
    messages = [m async for m in s.stream("tasks/result", {"taskId": task_id})]
    assert s.last_content_type.startswith("application/json")
    assert messages[-1]["result"]["content"][0]["text"] == "slept 0.3s"


async def test_tasks_result_streams_when_the_task_outlasts_the_grace_period_T_RES_3(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with serve(make_settings(database_url, result_grace_ms=100)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("sleep", {"seconds": 0.4}))["task"]["taskId"]
        messages = [m async for m in s.stream("tasks/result", {"taskId": task_id})]
    assert s.last_content_type.startswith("text/event-stream")
    assert messages[-1]["result"]["content"][0]["text"] == "slept 0.4s"


async def test_a_task_goes_straight_to_a_free_local_runner_slot(database_url: str, http: httpx.AsyncClient) -> None:
    """With a free slot in the creating process the task is created already leased to its runner (no
    claim round trip); with none, it is created unleased and waits for a claim, which the slot
    freeing up triggers at once (the claim loop's poll is a minute away here)."""
    async with serve(make_settings(database_url, runner_concurrency=1, poll_interval_ms=60_000)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        runner = running.app.state.core.runner
        # The claim loop's first pass (at start-up) holds the one slot while its query runs; a
        # create that lands meanwhile rightly finds no free slot. Start from an idle runner.
        async with asyncio.timeout(10):
            while runner.ledger.free < runner.concurrency:
                await asyncio.sleep(0.01)
        first = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        second = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        db = await asyncpg.connect(database_url)
        try:
            rows = {
                r["task_id"]: r for r in await db.fetch("SELECT task_id, lease_owner, attempts, started_at FROM tasks")
            }
        finally:
            await db.close()
        assert (rows[first]["lease_owner"], rows[first]["attempts"]) == (runner.owner, 1)
        assert rows[first]["started_at"] is not None
        assert (rows[second]["lease_owner"], rows[second]["attempts"]) == (None, 0)
        await s.result("tasks/cancel", {"taskId": first})  # frees the slot: the runner claims the second
        db = await asyncpg.connect(database_url)
        try:
            for _ in range(50):
                if await db.fetchval("SELECT lease_owner FROM tasks WHERE task_id = $1", second) == runner.owner:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the waiting task was not claimed when the slot freed")
        finally:
            await db.close()
