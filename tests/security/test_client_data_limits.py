"""Issue 14 findings 4 and 7: what one principal makes the service store or hold is bounded
(sessions, declared capabilities and clientInfo, open GET streams), capabilities are stored once
per session, and lookups and lists read only the columns they answer with (SECURITY.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import asyncpg
import httpx

from service.store.queries import Q
from tests.conftest import http_client, make_settings, serve
from tests.ext import V2026Client
from tests.rpc import RpcSession


async def _initialize(http: httpx.AsyncClient, url: str, params: dict[str, Any]) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}
    return await http.post(url, json=body, headers={"Accept": "application/json, text/event-stream"})


async def test_sessions_beyond_the_cap_end_the_least_recently_used(database_url: str) -> None:
    """Issue 14 §4 (sessions per principal were uncapped): with MCP_TASKS_MAX_SESSIONS_PER_PRINCIPAL
    at 5, eight initializes leave five sessions; the oldest three answer 404 (H-SESS-5: start anew)."""
    async with (
        serve(make_settings(database_url, max_sessions_per_principal=5)) as server,
        http_client(10) as http,
    ):
        sessions = []
        for _ in range(8):
            rpc = RpcSession(http, server.url)
            await rpc.initialize()
            sessions.append(rpc)
        for i, rpc in enumerate(sessions):
            r = await http.post(server.url, json=rpc.message("ping"), headers=rpc.headers())
            assert r.status_code == (404 if i < 3 else 200), (i, r.text)
        conn = await asyncpg.connect(database_url)
        try:
            assert await conn.fetchval("SELECT count(*) FROM sessions") == 5
        finally:
            await conn.close()


async def test_oversized_capabilities_or_client_info_are_refused_with_32602(database_url: str) -> None:
    """Issue 14 §4 (capabilities and clientInfo had no size limit): beyond
    MCP_TASKS_MAX_CLIENT_CAPABILITIES_BYTES / _CLIENT_INFO_BYTES, -32602 and nothing is stored, on both wires."""
    settings = make_settings(database_url, max_client_capabilities_bytes=1_024, max_client_info_bytes=512)
    async with serve(settings) as server, http_client(10) as http:
        base = {"protocolVersion": "2025-11-25", "clientInfo": {"name": "t", "version": "1"}}
        big_caps = await _initialize(http, server.url, {**base, "capabilities": {"x": "a" * 2_000}})
        assert big_caps.json()["error"]["code"] == -32602
        assert "mcp-session-id" not in big_caps.headers
        big_info = await _initialize(
            http, server.url, {**base, "capabilities": {}, "clientInfo": {"name": "t", "version": "b" * 1_000}}
        )
        assert big_info.json()["error"]["code"] == -32602
        not_object = await _initialize(http, server.url, {**base, "capabilities": ["elicitation"]})
        assert not_object.json()["error"]["code"] == -32602
        fine = await _initialize(http, server.url, {**base, "capabilities": {"x": "a" * 500}})
        assert "result" in fine.json()

        modern = V2026Client(http, server.url, capabilities={"x": "a" * 2_000})
        r = await modern.post("tools/call", {"name": "echo", "arguments": {"text": "hi"}})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == -32602
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM sessions") == 1
    finally:
        await conn.close()


async def test_get_streams_are_capped_per_session_and_per_principal(database_url: str) -> None:
    """Issue 14 §7 (1,198 GET streams open on one session): beyond MCP_TASKS_MAX_GET_STREAMS_PER_SESSION
    a GET gets 409, beyond MCP_TASKS_MAX_GET_STREAMS_PER_PRINCIPAL 429 + Retry-After; a closed
    stream frees its place."""
    settings = make_settings(database_url, max_get_streams_per_session=2, max_get_streams_per_principal=3)
    async with serve(settings) as server, http_client(10) as http:
        one, two = RpcSession(http, server.url), RpcSession(http, server.url)
        await one.initialize()
        await two.initialize()

        async def open_stream(stack: contextlib.AsyncExitStack, rpc: RpcSession) -> httpx.Response:
            return await stack.enter_async_context(
                http.stream("GET", server.url, headers=rpc.headers(Accept="text/event-stream"))
            )

        async with contextlib.AsyncExitStack() as stack:
            assert (await open_stream(stack, one)).status_code == 200
            assert (await open_stream(stack, one)).status_code == 200
            third = await open_stream(stack, one)
            assert third.status_code == 409
            await third.aread()
            assert (await open_stream(stack, two)).status_code == 200
            async with contextlib.AsyncExitStack() as inner:
                over = await open_stream(inner, two)
                assert over.status_code == 429
                assert over.headers["retry-after"]
                assert json.loads(await over.aread())["error"]["code"] == -32029
        # All closed: the places are free again (the server notices each disconnect).
        async with asyncio.timeout(5):
            while True:
                async with contextlib.AsyncExitStack() as stack:
                    if (await open_stream(stack, one)).status_code == 200:
                        break
                await asyncio.sleep(0.05)


async def test_a_sessions_capabilities_are_stored_once_not_in_every_task(database_url: str) -> None:
    """Issue 14 §4 (capabilities copied into every task row grew the database from 12 to 288 MB):
    task rows of a session keep no copy; the runner reads the session's, so a tool that needs
    elicitation still asks its question."""
    caps = {"elicitation": {}, "x-padding": "p" * 4_000}
    async with serve(make_settings(database_url)) as server, http_client(10) as http:
        rpc = RpcSession(http, server.url)
        await rpc.initialize(capabilities=caps)
        for _ in range(3):
            await rpc.result("tools/call", {"name": "echo", "arguments": {"text": "hi"}, "task": {}})
        created = await rpc.result("tools/call", {"name": "confirm", "arguments": {}, "task": {}})
        task_id = created["task"]["taskId"]
        async with asyncio.timeout(10):
            while (await rpc.result("tasks/get", {"taskId": task_id}))["status"] != "input_required":
                await asyncio.sleep(0.05)
    conn = await asyncpg.connect(database_url)
    try:
        stored = await conn.fetch("SELECT client_capabilities FROM tasks")
        assert len(stored) == 4
        assert all(row["client_capabilities"] == "{}" for row in stored)
        assert await conn.fetchval("SELECT count(*) FROM sessions WHERE client_capabilities ? 'x-padding'") == 1
    finally:
        await conn.close()


async def test_lookups_and_lists_do_not_read_arguments_or_capabilities(database_url: str) -> None:
    """Issue 14 §4 (eight clients listing large tasks took the server from 229 to 980 MB): a get
    or retrieve returns no arguments and no capabilities, and the list queries return none of
    arguments, capabilities or payload (their plans read none either: `make plans`)."""
    async with serve(make_settings(database_url)) as server, http_client(10) as http:
        rpc = RpcSession(http, server.url)
        await rpc.initialize()
        big = "a" * 200_000
        created = await rpc.result("tools/call", {"name": "echo", "arguments": {"text": big}, "task": {}})
        task_id = created["task"]["taskId"]
        result = await rpc.result("tasks/result", {"taskId": task_id})
        assert result["content"][0]["text"] == big  # the payload is still handed out
        listed = await rpc.result("tasks/list")
        assert [t["taskId"] for t in listed["tasks"]] == [task_id]
    conn = await asyncpg.connect(database_url)
    try:
        tenant, subject = await conn.fetchrow("SELECT tenant_id, subject FROM tasks WHERE task_id = $1", task_id)
        item = {"tenant_id": tenant, "task_id": task_id, "subject": subject}
        row = await conn.fetchrow("SELECT * FROM task_retrieve($1::jsonb)", json.dumps([item]))
        assert row["task_id"] == task_id
        assert row["arguments"] is None
        assert row["client_capabilities"] is None
        assert row["payload"] is not None
        await conn.execute("SELECT set_config('app.tenant_id', $1, false)", tenant)
        got = await conn.fetchrow("SELECT * FROM task_get($1, $2, $3)", [tenant], [task_id], [subject])
        assert "arguments" not in got.keys()  # noqa: SIM118 (a Record's `in` looks at its values)
        assert "client_capabilities" not in got.keys()  # noqa: SIM118
        assert got["payload"] is not None
        created_at = await conn.fetchval("SELECT created_at FROM tasks WHERE task_id = $1", task_id)
        pages = (
            ("list_tasks_first", (tenant, subject, 11)),
            ("list_tasks_after", (tenant, subject, created_at, "~", 11)),
        )
        for name, args in pages:  # ("~" sorts after every task id: the page after it holds the task)
            [listed] = await conn.fetch(Q[name], *args)
            assert listed["task_id"] == task_id
            assert not {"arguments", "client_capabilities", "payload"} & set(listed.keys()), name
    finally:
        await conn.close()


async def test_client_chosen_ids_and_progress_tokens_are_bounded(database_url: str) -> None:
    """Issue 42 §6 (a 900 KB progressToken was stored and repeated in every progress event): a
    request id or progressToken above 256 characters is refused on both wires, nothing stored."""
    async with serve(make_settings(database_url)) as server, http_client(10) as http:
        s = RpcSession(http, server.url)
        await s.initialize()
        params = {"name": "count", "arguments": {"n": 2}, "_meta": {"progressToken": "p" * 257}, "task": {}}
        refused = await s.error("tools/call", params)
        assert refused["code"] == -32602
        assert "256 characters" in refused["message"]
        params["_meta"] = {"progressToken": "p" * 256}  # at the limit: taken
        assert (await s.result("tools/call", params))["task"]["status"] == "working"
        long_id = {"jsonrpc": "2.0", "id": "i" * 257, "method": "tools/list", "params": {}}
        r = await http.post(server.url, json=long_id, headers=s.headers())
        assert r.status_code == 400
        assert "256 characters" in r.text

        c = V2026Client(http, server.url)
        body = c.body("tools/call", {"name": "count", "arguments": {"n": 2}}, progressToken="p" * 257)
        r = await c.post("tools/call", body=body, name="count")
        assert r.json()["error"]["code"] == -32602
        assert "progressToken" in r.json()["error"]["message"]
        body = {**c.body("tools/list"), "id": "i" * 257}
        assert (await c.post("tools/list", body=body)).status_code == 400
        conn = await asyncpg.connect(database_url)
        try:  # only the task at the limit was stored
            assert await conn.fetchval("SELECT count(*) FROM tasks") == 1
        finally:
            await conn.close()


async def test_a_listens_ids_each_spend_the_not_found_budget(database_url: str) -> None:
    """Issue 42 §6 (one listen of 256 unknown ids made 256 lookups and 256 deny rows against a budget
    of 60 a minute): each id is a lookup; once the budget is spent the listen is refused (429,
    Retry-After) with one rate_limited denial, and no further id is looked up."""
    async with serve(make_settings(database_url, rate_limit_not_found="5/minute")) as server, http_client(10) as http:
        c = V2026Client(http, server.url)
        body = c.body("subscriptions/listen", {"notifications": {"taskIds": [f"guess-{n}" for n in range(256)]}})
        r = await c.post("subscriptions/listen", body=body)
        assert r.status_code == 429
        assert r.headers["retry-after"]
        assert r.json()["error"]["code"] == -31029  # the wire's rate limit
    conn = await asyncpg.connect(database_url)
    try:
        denials = await conn.fetch("SELECT outcome FROM audit_events WHERE action = 'deny' ORDER BY seq")
    finally:
        await conn.close()
    assert [d["outcome"] for d in denials] == ["not_found"] * 5 + ["rate_limited"]
