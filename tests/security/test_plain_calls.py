"""Issue 14 finding 7: plain (non-task) calls hold their requestor's active-task slots, and a call
whose client went away does not run on for its full length (1,000 abandoned sleep(600) calls did)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer, http_client, make_settings, serve
from tests.ext import V2026Client
from tests.rpc import RpcSession
from tests.security.conftest import raw_socket
from tests.toolpack import signal


def _plain_calls(server: RunningServer) -> dict[tuple[str, str], int]:
    """The plain calls the server process runs now, per requestor (its own bookkeeping)."""
    counts: dict[tuple[str, str], int] = server.app.state.core.tasks.plain.running
    return counts


async def _post_in_background(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> asyncio.Task[Any]:
    return asyncio.create_task(http.post(url, json=body, headers=headers))


async def _disconnect(request: asyncio.Task[Any]) -> None:
    """Cancelling the request makes httpx close its connection: the client is gone."""
    request.cancel()
    with contextlib.suppress(BaseException):
        await request


async def test_plain_calls_hold_the_requestors_slots_and_are_refused_beyond_the_cap(database_url: str) -> None:
    """Issue 14 §7: with MCP_TASKS_MAX_ACTIVE_TASKS_PER_REQUESTOR at 2, two running plain calls
    fill it: a third plain call and a task create get the create's -32000 (scope requestor); a
    cancelled call gives its slot back."""
    settings = make_settings(database_url, max_active_tasks_per_requestor=2)
    async with serve(settings) as server, http_client(10) as http:
        rpc = RpcSession(http, server.url)
        await rpc.initialize()
        keys = [secrets.token_hex(4) for _ in range(2)]
        messages = [rpc.message("tools/call", {"name": "hang", "arguments": {"key": k}}) for k in keys]
        running = [await _post_in_background(http, server.url, m, rpc.headers()) for m in messages]
        async with asyncio.timeout(5):
            for k in keys:
                await signal(k, "started").wait()

        plain = await rpc.send("tools/call", {"name": "echo", "arguments": {"text": "x"}})
        assert plain["error"]["code"] == -32000
        assert plain["error"]["data"]["scope"] == "requestor"
        assert plain["error"]["data"]["current"] == 2
        create = await rpc.send("tools/call", {"name": "echo", "arguments": {"text": "x"}, "task": {}})
        assert create["error"]["code"] == -32000

        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": messages[0]["id"]}}
        assert (await http.post(server.url, json=cancel, headers=rpc.headers())).status_code == 202
        async with asyncio.timeout(5):
            await signal(keys[0], "cancelled").wait()
            await running[0]
            while _plain_calls(server).get(("local", "local"), 0) != 1:
                await asyncio.sleep(0.02)
        assert "result" in await rpc.send("tools/call", {"name": "echo", "arguments": {"text": "x"}})
        await _disconnect(running[1])


async def test_a_plain_call_counts_tasks_from_a_remembered_count_but_is_refused_only_on_a_fresh_one(
    database_url: str,
) -> None:
    """Issue 15 (plain calls read the counters at most once a second, docs/decisions.md "Plain calls
    and the cap"): a burst of plain calls reads the requestor's count once; a task this process
    creates is seen by the next plain call at once; a remembered count at the cap is read again
    before a refusal, so a task cancelled meanwhile frees its slot at once."""
    settings = make_settings(database_url, max_active_tasks_per_requestor=2)
    async with serve(settings) as server, http_client(10) as http:
        rpc = RpcSession(http, server.url)
        await rpc.initialize()
        tasks = server.app.state.core.tasks
        reads = 0
        counted = tasks.store.active_for

        async def counting(principal: Any) -> int:
            nonlocal reads
            reads += 1
            return int(await counted(principal))

        tasks.store.active_for = counting
        for _ in range(5):
            assert "result" in await rpc.send("tools/call", {"name": "echo", "arguments": {"text": "x"}})
        assert reads == 1  # one read for the burst

        keys = [secrets.token_hex(4) for _ in range(2)]
        task_ids = []
        for k in keys:
            created = await rpc.send("tools/call", {"name": "hang", "arguments": {"key": k}, "task": {}})
            task_ids.append(created["result"]["task"]["taskId"])
        async with asyncio.timeout(5):
            for k in keys:
                await signal(k, "started").wait()
        refused = await rpc.send("tools/call", {"name": "echo", "arguments": {"text": "x"}})
        assert refused["error"]["code"] == -32000  # the creates were seen at once
        assert refused["error"]["data"]["current"] == 2

        cancelled = await rpc.send("tasks/cancel", {"taskId": task_ids[0]})
        assert cancelled["result"]["status"] == "cancelled"
        before = reads
        assert "result" in await rpc.send("tools/call", {"name": "echo", "arguments": {"text": "x"}})
        assert reads == before + 1  # at the cap by the remembered count: counted again, admitted
        await rpc.send("tasks/cancel", {"taskId": task_ids[1]})


# Our server tells the endpoint of a client's leaving itself (service/http_server.py, mcp.direct);
# under another ASGI server the endpoint reads it from ``receive``: both are checked.
SERVERS = pytest.mark.parametrize("ours", [True, False], ids=["our-http-server", "any-asgi-server"])


@SERVERS
async def test_a_legacy_plain_call_is_cancelled_after_the_grace_once_its_client_disconnects(
    database_url: str, ours: bool
) -> None:
    """Issue 14 §7, docs/decisions.md: 2025-11-25 does not make a disconnect a cancellation, so
    the call is given MCP_TASKS_PLAIN_CALL_DISCONNECT_GRACE_S, then cancelled."""
    async with (
        serve(make_settings(database_url, plain_call_disconnect_grace_s=1.0), ours=ours) as server,
        http_client(10) as http,
    ):
        rpc = RpcSession(http, server.url)
        await rpc.initialize()
        key = secrets.token_hex(4)
        body = rpc.message("tools/call", {"name": "hang", "arguments": {"key": key}})
        request = await _post_in_background(http, server.url, body, rpc.headers())
        async with asyncio.timeout(5):
            await signal(key, "started").wait()
        await _disconnect(request)
        gone_at = time.monotonic()
        with contextlib.suppress(TimeoutError):  # not at once: within the grace it may reconnect
            await asyncio.wait_for(signal(key, "cancelled").wait(), timeout=0.6)
        assert not signal(key, "cancelled").is_set()
        async with asyncio.timeout(5):
            await signal(key, "cancelled").wait()
        assert 0.9 < time.monotonic() - gone_at < 4
        async with asyncio.timeout(2):  # and its slot is given back as the call ends
            while _plain_calls(server):
                await asyncio.sleep(0.02)


async def test_a_legacy_plain_call_streaming_progress_is_cancelled_once_its_client_disconnects(
    database_url: str,
) -> None:
    """Issue 14 §7: the same for a call answering on an SSE stream (progress before the result)."""
    async with (
        serve(make_settings(database_url, plain_call_disconnect_grace_s=0.2)) as server,
        http_client(10) as http,
    ):
        rpc = RpcSession(http, server.url)
        await rpc.initialize()
        params = {"name": "count", "arguments": {"n": 1_000, "interval_ms": 50}, "_meta": {"progressToken": 1}}
        async with http.stream("POST", server.url, json=rpc.message("tools/call", params),
                               headers=rpc.headers()) as r:  # fmt: skip
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if "notifications/progress" in line:
                    break
            assert _plain_calls(server) == {("local", "local"): 1}
        async with asyncio.timeout(5):  # the stream is closed: the call stops after the grace
            while _plain_calls(server):
                await asyncio.sleep(0.02)


@SERVERS
async def test_a_2026_plain_call_is_cancelled_as_soon_as_its_client_disconnects(database_url: str, ours: bool) -> None:
    """Issue 14 §7, X-HTTP-7: on 2026-07-28 closing the request cancels the call, with no grace."""
    async with (
        serve(make_settings(database_url, plain_call_disconnect_grace_s=60), ours=ours) as server,
        http_client(10) as http,
    ):
        modern = V2026Client(http, server.url, capabilities={})  # not declaring tasks: a plain call
        key = secrets.token_hex(4)
        body = modern.body("tools/call", {"name": "hang", "arguments": {"key": key}})
        request = await _post_in_background(http, server.url, body, modern.headers("tools/call", "hang"))
        async with asyncio.timeout(5):
            await signal(key, "started").wait()
        assert sum(_plain_calls(server).values()) == 1  # it holds a slot too
        await _disconnect(request)
        async with asyncio.timeout(3):
            await signal(key, "cancelled").wait()
            while _plain_calls(server):
                await asyncio.sleep(0.02)


async def test_a_2026_plain_call_with_a_request_pipelined_behind_it_is_cancelled_when_its_client_goes(
    database_url: str,
) -> None:
    """X-HTTP-7 on a connection that sent a second request behind the call (HTTP/1.1 pipelining):
    uvicorn marks only the latest request disconnected, but the call waiting to hear it is told too."""
    async with (
        serve(make_settings(database_url, plain_call_disconnect_grace_s=60)) as server,
        http_client(10) as http,
    ):
        modern = V2026Client(http, server.url, capabilities={})
        key = secrets.token_hex(4)

        def raw(method: str, params: dict[str, Any], name: str | None) -> bytes:
            body = json.dumps(modern.body(method, params)).encode()
            lines = [f"{k}: {v}" for k, v in modern.headers(method, name).items()]
            head = "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "\r\n".join(lines)
            return f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body

        async with raw_socket(server.url) as (_reader, writer):
            writer.write(
                raw("tools/call", {"name": "hang", "arguments": {"key": key}}, "hang")
                + raw("server/discover", {}, None)
            )
            async with asyncio.timeout(5):
                await signal(key, "started").wait()
        async with asyncio.timeout(3):  # the socket is closed: the call is cancelled at once
            await signal(key, "cancelled").wait()
            while _plain_calls(server):
                await asyncio.sleep(0.02)
