"""The 2026-07-28 Tasks extension on the same endpoint and the same tasks (X-*, XD-*)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from service.client import sse_messages
from tests.conftest import RunningServer, make_settings, serve
from tests.ext import EXT, V2026Client
from tests.rpc import RpcSession
from tests.test_durability import mcp_tasks


@pytest.fixture
async def server(database_url: str) -> AsyncIterator[RunningServer]:
    async with serve(make_settings(database_url, task_grace_ms=200)) as running:
        yield running


@pytest.fixture
def m(http: httpx.AsyncClient, server: RunningServer) -> V2026Client:
    return V2026Client(http, server.url)


async def settle(m: V2026Client, task_id: str, *statuses: str) -> dict[str, Any]:
    async with asyncio.timeout(20):
        while True:
            task = await m.result("tasks/get", {"taskId": task_id})
            if task["status"] in statuses:
                return task
            await asyncio.sleep(0.05)


async def test_discover_advertises_the_extension_and_both_versions_X_NEG_1_2_3(m: V2026Client) -> None:
    result = await m.result("server/discover")
    assert result["resultType"] == "complete"
    assert result["supportedVersions"] == ["2026-07-28", "2025-11-25"]
    assert result["capabilities"]["extensions"] == {EXT: {}}
    assert "tasks" not in result["capabilities"]
    assert result["cacheScope"] == "private"
    assert isinstance(result["ttlMs"], int)
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "mcp-task-service"
    # Without upstreams the tools never change, so no list_changed is promised (or agreed to below).
    assert result["capabilities"]["tools"] == {"listChanged": False}


async def test_a_listen_agrees_only_to_notifications_this_server_sends(m: V2026Client, http: httpx.AsyncClient) -> None:
    """SubscriptionsAcknowledgedNotification: the ack names only the types the server supports.
    Without upstreams the tool list never changes (with them: tests/test_upstreams.py)."""
    body = m.body("subscriptions/listen", {"notifications": {"toolsListChanged": True, "promptsListChanged": True}})
    async with http.stream("POST", m.url, content=orjson.dumps(body), headers=m.headers("subscriptions/listen")) as r:
        ack = await anext(sse_messages(r))
    assert ack["method"] == "notifications/subscriptions/acknowledged"
    assert ack["params"]["notifications"] == {}
    bad = m.body("subscriptions/listen", {"notifications": {"toolsListChanged": "yes"}})
    refused = await m.post("subscriptions/listen", body=bad)
    assert refused.json()["error"]["code"] == -32602  # (HTTP 200, as the taskIds checks below)
    assert "toolsListChanged" in refused.json()["error"]["message"]


async def test_a_tool_is_told_whether_its_progress_reaches_anyone_X_NOTIF_8(
    m: V2026Client, http: httpx.AsyncClient, server: RunningServer
) -> None:
    """ToolContext.reports_progress: True only while its progress reaches someone, so a tool that
    wakes up just to report progress (the demo sleep) need not. A 2025-11-25 call: when its request
    sent progressToken, as a task or not. A 2026-07-28 call: while it runs inside a request that
    sent one (XD-18), and once it became a task, where its progress is the task's status message
    (no progress notifications for tasks, X-NOTIF-8; docs/decisions.md, "Progress as status")."""
    texts = []
    modern = await m.result("tools/call", {"name": "progress_wanted", "arguments": {}})
    texts.append(modern["content"][0]["text"])

    async def with_token(arguments: dict[str, Any]) -> dict[str, Any]:
        body = m.body("tools/call", {"name": "progress_wanted", "arguments": arguments}, progressToken="p")
        async with http.stream("POST", m.url, content=orjson.dumps(body),
                               headers=m.headers("tools/call", "progress_wanted")) as r:  # fmt: skip
            result: dict[str, Any] = [msg async for msg in sse_messages(r)][-1]["result"]
            return result

    inline = await with_token({})
    assert inline["content"][0]["text"] == "reports_progress=True"
    became = await with_token({"seconds": 1.0})
    assert became["resultType"] == "task"  # past the grace (task_grace_ms): it became a task
    done = await settle(m, became["taskId"], "completed")
    assert done["result"]["content"][0]["text"] == "reports_progress=True->True"
    s = RpcSession(http, server.url)
    await s.initialize()
    for meta in ({}, {"_meta": {"progressToken": "p"}}):
        plain = await s.result("tools/call", {"name": "progress_wanted", "arguments": {}, **meta})
        texts.append(plain["content"][0]["text"])
        task_id = (await s.call_tool_as_task("progress_wanted", {}, **meta))["task"]["taskId"]
        texts.append((await s.result("tasks/result", {"taskId": task_id}))["content"][0]["text"])
    assert texts == ["reports_progress=False"] * 3 + ["reports_progress=True"] * 2


async def test_a_fast_optional_tool_answers_synchronously_X_CREATE_7(m: V2026Client) -> None:
    result = await m.result("tools/call", {"name": "echo", "arguments": {"text": "hi"}})
    assert result["resultType"] == "complete"
    assert result["content"] == [{"type": "text", "text": "hi"}]


async def test_a_slow_tool_becomes_a_task_committed_before_the_answer_X_CREATE_1_3(m: V2026Client) -> None:
    created = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 0.6}})
    assert created["resultType"] == "task"
    assert "task" not in created
    assert created["status"] == "working"
    assert isinstance(created["ttlMs"], int)
    assert isinstance(created["pollIntervalMs"], int)
    assert "ttl" not in created
    assert "pollInterval" not in created
    task_id = created["taskId"]
    got = await m.result("tasks/get", {"taskId": task_id})  # at once: it is committed (X-CREATE-3)
    assert got["resultType"] == "complete"
    assert got["status"] in ("working", "completed")
    done = await settle(m, task_id, "completed")
    assert done["result"]["content"] == [{"type": "text", "text": "slept 0.6s"}]
    assert done["result"]["resultType"] == "complete"  # XD-13


async def test_a_non_declaring_request_never_gets_a_task_X_NEG_5_7(
    http: httpx.AsyncClient, server: RunningServer
) -> None:
    plain = V2026Client(http, server.url, capabilities={"tasks": {}})  # a legacy key does not declare (X-NEG-8)
    result = await plain.result("tools/call", {"name": "sleep", "arguments": {"seconds": 0.3}})
    assert result["resultType"] == "complete"
    error = await plain.error("tools/call", {"name": "batch", "arguments": {}}, status=400)
    assert error["code"] == -32021
    assert error["data"] == {"requiredCapabilities": {"extensions": {EXT: {}}}}
    for method in ("tasks/get", "tasks/update", "tasks/cancel"):
        error = await plain.error(method, {"taskId": "x", "inputResponses": {}}, status=400)
        assert error["code"] == -32021  # X-GET-9: checked before the lookup


async def test_legacy_task_param_is_ignored_X_NEG_9(m: V2026Client) -> None:
    result = await m.result("tools/call", {"name": "echo", "arguments": {"text": "x"}, "task": {"ttl": 1000}})
    assert result["resultType"] == "complete"


async def test_headers_must_match_the_body_X_HTTP_1_2_4(m: V2026Client) -> None:
    created = await m.result("tools/call", {"name": "slow_fail", "arguments": {}})
    task_id = created["taskId"]
    headers = m.headers("tasks/get")  # no Mcp-Name
    assert (await m.error("tasks/get", {"taskId": task_id}, headers=headers, status=400))["code"] == -32020
    wrong = m.headers("tasks/get", "someone-else")
    assert (await m.error("tasks/get", {"taskId": task_id}, headers=wrong, status=400))["code"] == -32020
    import base64

    encoded = "=?base64?" + base64.b64encode(task_id.encode()).decode() + "?="
    r = await m.post("tasks/get", {"taskId": task_id}, headers=m.headers("tasks/get", encoded))
    assert r.status_code == 200
    bad_method = m.headers("tasks/cancel", task_id)
    assert (await m.error("tasks/get", {"taskId": task_id}, headers=bad_method, status=400))["code"] == -32020
    no_version = {k: v for k, v in m.headers("tasks/get", task_id).items() if k != "MCP-Protocol-Version"}
    r = await m.post("tasks/get", {"taskId": task_id}, headers=no_version)
    assert (r.status_code, r.json()["error"]["code"]) == (400, -32020)


async def test_a_missing_routing_header_is_refused_as_missing_and_named_X_HTTP_1(m: V2026Client) -> None:
    """docs/decisions.md, "A missing Mcp-Name": a client that omits Mcp-Name (fastmcp-tasks 4.1.4
    on tasks/get) or Mcp-Method gets -32020 saying the header is missing, which one, and the value
    it must carry; the task is unchanged and the same request with the header succeeds."""
    created = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 30}})
    task_id = created["taskId"]
    for method, params in (
        ("tasks/get", {"taskId": task_id}),
        ("tasks/update", {"taskId": task_id, "inputResponses": {}}),
    ):
        error = await m.error(method, params, headers=m.headers(method), status=400)
        assert error["code"] == -32020
        assert "missing" in error["message"].lower()
        assert error["data"] == {"header": "Mcp-Name", "expected": task_id}
    no_method = {k: v for k, v in m.headers("tasks/get", task_id).items() if k != "Mcp-Method"}
    error = await m.error("tasks/get", {"taskId": task_id}, headers=no_method, status=400)
    assert (error["code"], error["data"]) == (-32020, {"header": "Mcp-Method", "expected": "tasks/get"})
    assert (await m.result("tasks/get", {"taskId": task_id}))["status"] == "working"
    await m.result("tasks/cancel", {"taskId": task_id})


async def test_an_unknown_version_lists_both_X_NEG_11(m: V2026Client) -> None:
    r = await m.post("tools/list", headers={**m.headers("tools/list"), "MCP-Protocol-Version": "2026-06-30"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == -32022
    assert error["data"]["supported"] == ["2026-07-28", "2025-11-25"]  # as server/discover lists them
    assert error["data"]["requested"] == "2026-06-30"


async def test_removed_methods_are_404_X_HTTP_5(m: V2026Client) -> None:
    for method in ("tasks/result", "tasks/list", "ping"):
        error = await m.error(method, {"taskId": "x"}, status=404, name="x")
        assert error["code"] == -32601


async def test_unknown_and_malformed_requests_get_their_errors_X_ERR(m: V2026Client) -> None:
    assert (await m.error("tasks/get", {"taskId": "no-such-task"}))["code"] == -32602
    assert (await m.error("tasks/cancel", {"taskId": "no-such-task"}))["code"] == -32602
    no_meta = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    r = await m.post("tools/list", body=no_meta)
    assert (r.status_code, r.json()["error"]["code"]) == (400, -32602)
    bad_caps = m.body("tools/list")
    bad_caps["params"]["_meta"]["io.modelcontextprotocol/clientCapabilities"] = {"extensions": {EXT: True}}
    r = await m.post("tools/list", body=bad_caps)
    assert (r.status_code, r.json()["error"]["code"]) == (400, -32602)  # XD-23


async def test_a_tool_error_is_completed_here_and_failed_on_2025_11_25_X_STATE_4(
    m: V2026Client, http: httpx.AsyncClient, server: RunningServer
) -> None:
    """One stored outcome, two renderings; and a legacy-created task read through the modern wire (XD-3)."""
    s = RpcSession(http, server.url)
    await s.initialize()
    legacy_id = (await s.call_tool_as_task("fail", {"message": "broken"}))["task"]["taskId"]
    async with asyncio.timeout(10):
        while (await s.result("tasks/get", {"taskId": legacy_id}))["status"] != "failed":
            await asyncio.sleep(0.05)
    modern_view = await m.result("tasks/get", {"taskId": legacy_id})
    assert modern_view["status"] == "completed"
    assert modern_view["result"]["isError"] is True
    created = await m.result("tools/call", {"name": "slow_fail", "arguments": {}})
    done = await settle(m, created["taskId"], "completed")
    assert done["result"]["isError"] is True
    # XD-3: a 2025-11-25 session never sees a task created through the extension.
    assert (await s.error("tasks/get", {"taskId": created["taskId"]}))["code"] == -32602


async def test_a_legacy_task_can_be_cancelled_through_the_modern_wire_XD_3(
    m: V2026Client, http: httpx.AsyncClient, server: RunningServer
) -> None:
    s = RpcSession(http, server.url)
    await s.initialize()
    legacy_id = (await s.call_tool_as_task("sleep", {"seconds": 30}))["task"]["taskId"]
    assert (await m.result("tasks/cancel", {"taskId": legacy_id})) == {
        "resultType": "complete",
        "_meta": {"io.modelcontextprotocol/serverInfo": (await m.result("server/discover"))["_meta"][
            "io.modelcontextprotocol/serverInfo"]},
    }  # fmt: skip
    assert (await s.result("tasks/get", {"taskId": legacy_id}))["status"] == "cancelled"
    again = await m.result("tasks/cancel", {"taskId": legacy_id})  # X-CANCEL-5: terminal → ack
    assert again["resultType"] == "complete"


async def test_input_before_a_task_goes_round_trip_then_inside_a_task_by_key_X_CREATE_5_X_UPDATE(
    m: V2026Client,
) -> None:
    """MRTR first: the synchronous round asks (InputRequiredResult), the retry answers it. Then a
    tool that asks after it became a task: inputRequests on tasks/get, answered by tasks/update."""
    first = await m.result("tools/call", {"name": "confirm", "arguments": {"prompt": "ok?"}})
    assert first["resultType"] == "input_required"
    [(key, request)] = first["inputRequests"].items()
    assert request["method"] == "elicitation/create"
    assert request["params"]["message"] == "ok?"
    retry = {"name": "confirm", "arguments": {"prompt": "ok?"},
             "inputResponses": {key: {"action": "accept", "content": {"ok": True}}}}  # fmt: skip
    answered = await m.result("tools/call", retry)
    assert answered["resultType"] == "complete"
    assert answered["content"][0]["text"] == "answer: ok=True"

    created = await m.result("tools/call", {"name": "slow_confirm", "arguments": {"seconds": 0.4}})
    assert created["resultType"] == "task"
    waiting = await settle(m, created["taskId"], "input_required")
    [(task_key, task_request)] = waiting["inputRequests"].items()
    assert task_key != key  # separate namespaces (X-CREATE-5)
    assert task_request["params"]["message"] == "Go on?"
    bad = {"taskId": created["taskId"], "inputResponses": {task_key: {"action": "perhaps"}}}
    assert (await m.error("tasks/update", bad))["code"] == -32602  # XD-9: nothing applied
    nested = {"taskId": created["taskId"], "inputResponses": {task_key: {"action": "accept",
                                                                         "content": {"ok": {"nested": True}}}}}  # fmt: skip
    refused = await m.error("tasks/update", nested)  # not a form's value (ElicitResult.content)
    assert refused["code"] == -32602
    assert "content.ok" in refused["message"]
    assert (await m.result("tasks/get", {"taskId": created["taskId"]}))["status"] == "input_required"
    update = {"taskId": created["taskId"], "inputResponses": {"never-issued": {"action": "accept"},
                                                              task_key: {"action": "accept", "content": {"ok": True}}}}  # fmt: skip
    assert (await m.result("tasks/update", update))["resultType"] == "complete"
    after = await m.result("tasks/get", {"taskId": created["taskId"]})
    assert "inputRequests" not in after  # XD-10: answered keys are gone at once
    done = await settle(m, created["taskId"], "completed")
    assert done["result"]["content"][0]["text"] == "accept:True"


async def test_a_subscription_gets_the_snapshot_and_each_change_of_own_tasks_only_XD_14(
    m: V2026Client, http: httpx.AsyncClient, server: RunningServer
) -> None:
    created = await m.result("tools/call", {"name": "slow_confirm", "arguments": {"seconds": 0.3}})
    task_id = created["taskId"]
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(20):
        async for msg in m.listen([task_id, "not-mine-or-unknown"]):
            seen.append(msg)
            if msg["method"] == "notifications/tasks" and msg["params"]["status"] == "input_required":
                key = next(iter(msg["params"]["inputRequests"]))
                await m.result("tasks/update", {"taskId": task_id, "inputResponses": {key: {"action": "decline"}}})
            if msg["method"] == "notifications/tasks" and msg["params"]["status"] == "completed":
                break
    ack = seen[0]
    assert ack["method"] == "notifications/subscriptions/acknowledged"
    assert ack["params"]["notifications"] == {"taskIds": [task_id]}
    sub_ids = {msg["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] for msg in seen}
    assert len(sub_ids) == 1
    statuses = [msg["params"]["status"] for msg in seen[1:]]
    assert statuses[0] == "working"  # the snapshot right after the ack
    assert "input_required" in statuses
    assert seen[-1]["params"]["result"]["content"][0]["text"] == "decline:None"
    assert all(msg["method"] != "notifications/progress" for msg in seen)  # X-NOTIF-8


async def test_a_tasks_progress_is_its_status_message_on_tasks_get_and_in_notifications_X_NOTIF_8(
    m: V2026Client,
) -> None:
    """docs/decisions.md, "Progress as status": progress notifications reach no one once a call is
    a task (X-NOTIF-8), so its statusMessage carries the latest report ("40 % — counted 2 of 5"),
    at most once a second, the last one always; a subscription sees it change; the finished task's
    own message replaces it."""
    created = await m.result("tools/call", {"name": "count", "arguments": {"n": 5, "interval_ms": 700}})
    assert created["resultType"] == "task"
    task_id = created["taskId"]
    messages: list[str] = []
    async with asyncio.timeout(20):
        async for msg in m.listen([task_id]):
            if msg["method"] != "notifications/tasks":
                continue
            if msg["params"]["status"] == "completed":
                final = msg["params"]
                break
            if (text := msg["params"].get("statusMessage")) and text not in messages:
                messages.append(text)
    assert messages, "no progress reached the task's status"
    assert all(re.fullmatch(r"\d+ % — counted \d of 5", text) for text in messages), messages
    shares = [int(text.split(" ")[0]) for text in messages]
    assert shares == sorted(shares)
    assert "statusMessage" not in final or "counted" not in final["statusMessage"]
    got = await m.result("tasks/get", {"taskId": task_id})
    assert got["status"] == "completed"


@pytest.mark.slow
async def test_a_subscription_on_one_process_sees_a_task_run_by_another(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """The task is created where no runner runs and executed by a worker process: every status
    change reaches the subscription through PostgreSQL."""
    settings = make_settings(database_url, runner_concurrency=0, task_grace_ms=100)
    async with serve(settings) as front, mcp_tasks("worker", database_url) as (_worker, _url):
        m = V2026Client(http, front.url)
        created = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 0.5}})
        assert created["resultType"] == "task"
        statuses: list[str] = []
        async with asyncio.timeout(30):
            async for msg in m.listen([created["taskId"]]):
                if msg["method"] == "notifications/tasks":
                    statuses.append(msg["params"]["status"])
                    if msg["params"]["status"] == "completed":
                        assert msg["params"]["result"]["content"][0]["text"] == "slept 0.5s"
                        break
        assert statuses[-1] == "completed"


async def test_a_listen_with_too_many_ids_or_bad_ids_is_refused(m: V2026Client) -> None:
    body = m.body("subscriptions/listen", {"notifications": {"taskIds": [f"t{i}" for i in range(10_000)]}})
    r = await m.post("subscriptions/listen", body=body)
    assert (r.status_code, r.json()["error"]["code"]) == (200, -32602)
    body = m.body("subscriptions/listen", {"notifications": {"taskIds": [1, 2]}})
    r = await m.post("subscriptions/listen", body=body)
    assert r.json()["error"]["code"] == -32602


async def test_questions_need_the_creating_requests_capabilities_XD_4(
    http: httpx.AsyncClient, server: RunningServer
) -> None:
    no_elicitation = V2026Client(http, server.url, capabilities={"extensions": {EXT: {}}})
    result = await no_elicitation.result("tools/call", {"name": "confirm", "arguments": {}})
    assert result["resultType"] == "complete"
    assert result["isError"] is True  # the tool was told the client cannot answer; nothing was asked


async def test_a_failed_call_is_its_json_rpc_error_without_details_XD_27(m: V2026Client) -> None:
    error = await m.error("tools/call", {"name": "crash", "arguments": {"message": "boom"}})
    assert error == {"code": -32603, "message": "boom"}
    error = await m.error("tools/call", {"name": "leaky", "arguments": {}})
    assert error["code"] == -32603
    assert "reference" in error["message"]
    assert "hunter2" not in str(error)


async def test_the_ttl_is_the_servers_default_XD_11(m: V2026Client, server: RunningServer) -> None:
    created = await m.result("tools/call", {"name": "slow_fail", "arguments": {}})
    assert created["ttlMs"] == server.settings.effective_default_ttl_ms


@pytest.fixture
async def conformance_server(database_url: str) -> AsyncIterator[RunningServer]:
    settings = make_settings(database_url, task_grace_ms=200, tools="service.tools.conformance,service.tools.demo")
    async with serve(settings) as running:
        yield running


async def test_multi_round_input_carries_the_answers_in_a_sealed_request_state_X_SEC_10(
    http: httpx.AsyncClient, conformance_server: RunningServer
) -> None:
    """Each round's requestState holds the answers so far (the server keeps nothing between rounds);
    a later round sends only its new answer; a tampered state is refused."""
    m = V2026Client(http, conformance_server.url, capabilities={"elicitation": {}})
    params: dict[str, Any] = {"name": "test_input_required_result_multi_round", "arguments": {}}
    first = await m.result("tools/call", params)
    assert first["resultType"] == "input_required"
    assert list(first["inputRequests"]) == ["step1"]  # the tool names its keys
    second = await m.result("tools/call", {**params, "requestState": first["requestState"],
                                           "inputResponses": {"step1": {"action": "accept", "content": {"name": "Alice"}}}})  # fmt: skip
    assert list(second["inputRequests"]) == ["step2"]
    assert second["requestState"] != first["requestState"]
    third = await m.result("tools/call", {**params, "requestState": second["requestState"],
                                          "inputResponses": {"step2": {"action": "accept", "content": {"color": "blue"}}}})  # fmt: skip
    assert third["resultType"] == "complete"
    assert "Alice" in third["content"][0]["text"]
    assert "blue" in third["content"][0]["text"]
    tampered = {**params, "requestState": second["requestState"] + "x",
                "inputResponses": {"step2": {"action": "accept", "content": {"color": "red"}}}}  # fmt: skip
    assert (await m.error("tools/call", tampered))["code"] == -32602
    other_tool = {
        "name": "test_input_required_result_elicitation",
        "arguments": {},
        "requestState": first["requestState"],
    }
    assert (await m.error("tools/call", other_tool))["code"] == -32602  # bound to its tool and arguments


async def test_progress_of_a_call_inside_its_request_streams_before_the_answer_XD_18(
    http: httpx.AsyncClient, conformance_server: RunningServer
) -> None:
    m = V2026Client(http, conformance_server.url, capabilities={})
    body = m.body("tools/call", {"name": "test_tool_with_progress", "arguments": {}}, progressToken="p-1")
    messages: list[dict[str, Any]] = []
    async with http.stream("POST", m.url, content=orjson.dumps(body),
                           headers=m.headers("tools/call", "test_tool_with_progress")) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        async for msg in sse_messages(r):
            messages.append(msg)
    progress = [msg["params"] for msg in messages if msg.get("method") == "notifications/progress"]
    assert len(progress) >= 3
    assert {p["progressToken"] for p in progress} == {"p-1"}
    assert [p["progress"] for p in progress] == sorted(p["progress"] for p in progress)
    assert messages[-1]["result"]["resultType"] == "complete"


async def test_a_tool_refusing_for_a_missing_capability_is_http_400(
    http: httpx.AsyncClient, conformance_server: RunningServer
) -> None:
    m = V2026Client(http, conformance_server.url, capabilities={})
    error = await m.error("tools/call", {"name": "test_missing_capability", "arguments": {}}, status=400)
    assert error["code"] == -32021
    assert error["data"] == {"requiredCapabilities": {"sampling": {}}}


async def test_initialize_and_other_removed_methods_are_404_on_2026_07_28(m: V2026Client) -> None:
    for method in ("initialize", "logging/setLevel", "resources/subscribe"):
        error = await m.error(method, {}, status=404, name="x")
        assert error["code"] == -32601


async def test_parameters_marked_as_headers_must_be_mirrored_X_HTTP_12(
    http: httpx.AsyncClient, conformance_server: RunningServer
) -> None:
    m = V2026Client(http, conformance_server.url, capabilities={})
    params = {"name": "test_custom_headers", "arguments": {"region": "Hello"}}
    ok = m.headers("tools/call", "test_custom_headers", **{"Mcp-Param-Region": "=?base64?SGVsbG8=?="})
    assert (await m.post("tools/call", params, headers=ok)).status_code == 200
    for bad in ("=?base64?SGVsbG8?=", "Other"):
        h = m.headers("tools/call", "test_custom_headers", **{"Mcp-Param-Region": bad})
        assert (await m.error("tools/call", params, headers=h, status=400))["code"] == -32020
    missing = m.headers("tools/call", "test_custom_headers")
    assert (await m.error("tools/call", params, headers=missing, status=400))["code"] == -32020


async def test_a_subscription_ends_with_its_result_when_the_token_expires_XD_14(
    http: httpx.AsyncClient, tenant_server: RunningServer, shared_issuer: Any
) -> None:
    token = shared_issuer.mint(tenant_server.url, tenant_id="t-expiring", sub="alice", exp=int(time.time()) + 2)
    m = V2026Client(http, tenant_server.url, token=token)
    created = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 30}})
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(15):
        async for msg in m.listen([created["taskId"]]):
            seen.append(msg)
    final = seen[-1]
    assert final["result"] == {"resultType": "complete",
                               "_meta": {"io.modelcontextprotocol/subscriptionId": final["id"]}}  # fmt: skip
    assert all("method" in msg for msg in seen[:-1])
    await V2026Client(http, tenant_server.url, token=shared_issuer.mint(
        tenant_server.url, tenant_id="t-expiring", sub="alice")).result("tasks/cancel", {"taskId": created["taskId"]})  # fmt: skip


async def test_a_subscription_ends_with_its_result_when_the_server_shuts_down_XD_14(
    m: V2026Client, server: RunningServer
) -> None:
    created = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 30}})
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(15):
        async for msg in m.listen([created["taskId"]]):
            seen.append(msg)
            if msg.get("method") == "notifications/tasks":
                server.app.state.v2026.closing.set()  # what SIGTERM does first (service/cli.py)
    assert seen[-1]["result"]["resultType"] == "complete"


async def test_another_principals_task_is_exactly_an_unknown_one_on_every_method_X_SEC_2_3(
    http: httpx.AsyncClient, tenant_server: RunningServer, shared_issuer: Any
) -> None:
    def client(tenant: str, sub: str) -> V2026Client:
        return V2026Client(
            http, tenant_server.url, token=shared_issuer.mint(tenant_server.url, tenant_id=tenant, sub=sub)
        )

    alice, bob, mallory = client("t-iso", "alice"), client("t-iso", "bob"), client("t-other", "alice")
    created = await alice.result("tools/call", {"name": "slow_confirm", "arguments": {"seconds": 0.8}})
    task_id = created["taskId"]
    await settle(alice, task_id, "input_required")
    for other in (bob, mallory):
        for method, params in (("tasks/get", {"taskId": task_id}), ("tasks/cancel", {"taskId": task_id}),
                               ("tasks/update", {"taskId": task_id, "inputResponses": {"q": {"action": "accept"}}})):  # fmt: skip
            foreign = await other.error(method, params)
            unknown = await other.error(method, {**params, "taskId": "never-existed"}, name="never-existed")
            # The same error but for the id it names back.
            assert {**foreign, "data": None} == {**unknown, "data": None}, method
            assert foreign["data"] == {"task_id": task_id}
        seen: list[dict[str, Any]] = []
        async with asyncio.timeout(5):
            async for msg in other.listen([task_id]):
                seen.append(msg)
                break
        assert seen[0]["params"]["notifications"] == {"taskIds": []}  # not acked: silently dropped
    assert (await alice.result("tasks/get", {"taskId": task_id}))["status"] == "input_required"
    await alice.result("tasks/cancel", {"taskId": task_id})


async def test_closing_a_subscription_leaves_nothing_behind(m: V2026Client, server: RunningServer) -> None:
    """Review finding: a client closing its listen stream left the watch (its subscription, its
    polls) alive; open-close loops piled them up."""
    created = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 30}})
    hub = server.app.state.core.hub
    topic = ("task", "local", created["taskId"])
    for _ in range(3):
        async with asyncio.timeout(5):
            async for msg in m.listen([created["taskId"]]):
                if msg.get("method") == "notifications/tasks":
                    break  # closes the stream
    async with asyncio.timeout(5):
        while hub.subscribers(topic):
            await asyncio.sleep(0.05)
    assert server.app.state.v2026.listening.open == {}
    await m.result("tasks/cancel", {"taskId": created["taskId"]})


async def test_our_refusals_use_application_codes_outside_the_reserved_range_X_ERR_2(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """X-ERR-2: no undefined code from -32020..-32099 (nor the legacy -32000..-32019) on 2026-07-28:
    the cap refusal is -31000, the rate limit -31029 with HTTP 429 and Retry-After; 2025-11-25 keeps
    -32000 and -32029 (docs/decisions.md)."""
    settings = make_settings(database_url, task_grace_ms=0, max_active_tasks_per_requestor=1, rate_limit="6/minute")
    async with serve(settings) as running:
        m = V2026Client(http, running.url)
        created = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 30}})
        assert created["resultType"] == "task"
        refused = (await m.post("tools/call", {"name": "sleep", "arguments": {"seconds": 30}})).json()
        assert refused["error"]["code"] == -31000, refused
        assert refused["error"]["data"]["scope"] == "requestor"
        codes = []
        for _ in range(8):
            response = await m.post("tasks/get", {"taskId": created["taskId"]})
            if response.status_code == 429:
                assert response.headers["Retry-After"].isdigit()
                codes.append(response.json()["error"]["code"])
        assert codes
        assert set(codes) == {-31029}
        legacy = RpcSession(http, running.url)
        response = await http.post(running.url, json=legacy.message("ping"), headers=legacy.headers())
        assert response.status_code == 429
        assert response.json()["error"]["code"] == -32029


async def test_request_state_keeps_only_the_answers_the_run_took_X_SEC_10(
    http: httpx.AsyncClient, conformance_server: RunningServer
) -> None:
    """Answers to keys the run never asked for are not sealed into the next round's requestState,
    so a client cannot grow the state round after round (it would otherwise carry whatever was sent)."""
    m = V2026Client(http, conformance_server.url, capabilities={"elicitation": {}})
    params: dict[str, Any] = {"name": "test_input_required_result_multi_round", "arguments": {}}
    first = await m.result("tools/call", params)
    padding = {f"junk{i}": {"action": "accept", "content": {"x": "y" * 200}} for i in range(40)}
    answers = {"step1": {"action": "accept", "content": {"name": "Alice"}}, **padding}
    second = await m.result("tools/call", {**params, "requestState": first["requestState"], "inputResponses": answers})
    assert list(second["inputRequests"]) == ["step2"]
    assert len(second["requestState"]) < len(first["requestState"]) + 400  # step1's answer only, not 8 KB of junk
    third = await m.result("tools/call", {**params, "requestState": second["requestState"],
                                          "inputResponses": {"step2": {"action": "accept", "content": {"color": "blue"}}}})  # fmt: skip
    assert "Alice" in third["content"][0]["text"]  # the answer the run took still travels
