"""Issue 14 finding 1: one unauthenticated client with idle, slow-header or huge-header sockets
must not be able to take the HTTP server away from every tenant (SECURITY.md "Connection limits")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from service import http_server
from tests.conftest import make_settings, serve
from tests.rpc import RpcSession
from tests.security.conftest import raw_socket, read_until_closed, status_of, trickle
from tests.test_durability import mcp_tasks

PING = b'{"jsonrpc":"2.0","id":1,"method":"ping"}'


def _refused(reason: str) -> float:
    """mcp_tasks_http_refusals_total{reason} as the in-process servers counted it so far."""
    return REGISTRY.get_sample_value("mcp_tasks_http_refusals_total", {"reason": reason}) or 0.0


def _healthz(extra_headers: bytes = b"") -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra_headers + b"\r\n"


async def test_a_socket_that_sends_nothing_is_closed_after_the_header_timeout(database_url: str) -> None:
    """Issue 14 §1 (idle-before-request sockets): closed after MCP_TASKS_HTTP_HEADER_TIMEOUT_S,
    without a response (nothing was asked)."""
    async with serve(make_settings(database_url, http_header_timeout_s=0.5)) as server:
        async with raw_socket(server.url) as (reader, _):
            started = time.monotonic()
            response = await read_until_closed(reader, timeout_s=5)
        assert response == b""
        assert 0.4 < time.monotonic() - started < 3


async def test_a_header_sent_a_byte_at_a_time_is_cut_off_at_the_header_timeout(database_url: str) -> None:
    """Issue 14 §1 (slowloris): the timeout bounds the whole header, however steadily bytes trickle in."""
    before = _refused("header_timeout")
    async with serve(make_settings(database_url, http_header_timeout_s=0.8)) as server:
        async with raw_socket(server.url) as (reader, writer):
            started = time.monotonic()
            closed = asyncio.ensure_future(read_until_closed(reader, timeout_s=5))
            await trickle(writer, closed, b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100)
            response = await closed
        assert status_of(response) == 408
        assert time.monotonic() - started < 3
    assert _refused("header_timeout") == before + 1


async def test_the_header_timeout_bounds_each_request_of_a_keep_alive_connection(database_url: str) -> None:
    """Issue 14 §1 on a kept-alive connection: the header timer is one per connection (armed by a
    request, not cancelled when its headers are in), so a later request whose headers trickle
    must still be cut off its own header timeout after it began, however early the timer an
    earlier request left fires, and quick requests must not be cut by it."""
    settings = make_settings(database_url, http_header_timeout_s=1.0)
    async with serve(settings) as server, raw_socket(server.url) as (reader, writer):
        started = time.monotonic()
        for i in range(4):  # quick requests over more than the timeout: each served
            writer.write(_healthz())
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert status_of(head) == 200
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            await asyncio.sleep(0.45 if i < 3 else 0.3)
        # The slow request begins while the timer the last quick one armed is pending: it
        # fires 0.3 s before this request's deadline.
        assert time.monotonic() - started > 1.0
        slow_from = time.monotonic()
        closed = asyncio.ensure_future(read_until_closed(reader, timeout_s=6))
        await trickle(writer, closed, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200)
        assert status_of(await closed) == 408
        assert 0.8 < time.monotonic() - slow_from < 3


async def test_a_connection_silent_before_its_first_byte_gets_no_second_header_timeout(database_url: str) -> None:
    """Issue 14 §1: the header timeout of a connection's first request runs from the connection,
    not from its first byte. A client silent for 0.8 of the timeout that then trickles its headers
    is cut off one timeout after it connected, not 1.8 (the first byte must not set it again)."""
    async with serve(make_settings(database_url, http_header_timeout_s=1.0)) as server:
        async with raw_socket(server.url) as (reader, writer):
            connected = time.monotonic()
            closed = asyncio.ensure_future(read_until_closed(reader, timeout_s=5))
            await asyncio.sleep(0.8)
            await trickle(writer, closed, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200)
            response = await closed
        assert status_of(response) == 408
        assert time.monotonic() - connected < 1.5


async def test_headers_beyond_the_limit_get_431_before_they_end(database_url: str) -> None:
    """Issue 14 §1 (10 MB headers were accepted and held): an unfinished header line beyond
    MCP_TASKS_HTTP_MAX_HEADER_BYTES is refused at once, without waiting for its end."""
    before = _refused("headers_too_large")
    async with serve(make_settings(database_url, http_max_header_bytes=8_192)) as server:
        async with raw_socket(server.url) as (reader, writer):
            writer.write(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000)
            await writer.drain()
            assert status_of(await read_until_closed(reader, timeout_s=5)) == 431
        async with raw_socket(server.url) as (reader, writer):  # many small headers, one chunk
            writer.write(_healthz(b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 100) for i in range(100))))
            await writer.drain()
            assert status_of(await read_until_closed(reader, timeout_s=5)) == 431
        async with raw_socket(server.url) as (reader, writer):  # below the limit: served
            writer.write(_healthz(b"X-Fine: " + b"c" * 4_000 + b"\r\nConnection: close\r\n"))
            await writer.drain()
            assert status_of(await read_until_closed(reader, timeout_s=5)) == 200
    assert _refused("headers_too_large") == before + 2


async def test_beyond_the_connection_cap_new_sockets_are_refused_while_open_ones_keep_working(
    database_url: str,
) -> None:
    """Issue 14 §1 (~1,100 idle sockets failed every tenant's requests): with MCP_TASKS_MAX_CONNECTIONS
    at 50, a client holding 60 idle sockets gets the ones beyond 50 refused at once (503), a tenant
    already connected keeps being served, and the idle ones go at the header timeout."""
    settings = make_settings(database_url, max_connections=50, http_header_timeout_s=2)
    before = _refused("connections")
    async with serve(settings) as server:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(timeout=10, limits=limits) as tenant:
            rpc = RpcSession(tenant, server.url)
            await rpc.initialize()  # the tenant's connection is open before the flood
            async with contextlib.AsyncExitStack() as flood:
                sockets = [await flood.enter_async_context(raw_socket(server.url)) for _ in range(60)]
                started = time.monotonic()
                refused = await asyncio.gather(*(read_until_closed(r, timeout_s=1.5) for r, _ in sockets[49:]))
                assert all(status_of(r) == 503 for r in refused)
                assert time.monotonic() - started < 1.5
                assert _refused("connections") == before + len(refused)
                for _ in range(5):
                    assert "result" in await rpc.send("ping")
                with contextlib.suppress(TimeoutError):  # the first 49 are held until the header timeout
                    await read_until_closed(sockets[0][0], timeout_s=0.2)
                    raise AssertionError("an idle socket under the cap was closed early")
                await asyncio.gather(*(read_until_closed(r, timeout_s=5) for r, _ in sockets[:49]))
            async with httpx.AsyncClient(timeout=10) as newcomer:  # room again
                r = await newcomer.get(server.url.replace("/mcp", "/healthz"))
                assert r.status_code == 200


async def test_beyond_the_request_cap_requests_get_503_with_retry_after(database_url: str) -> None:
    """Issue 14 §1: MCP_TASKS_MAX_CONCURRENT_REQUESTS bounds requests in progress (not idle
    connections); beyond it 503 with Retry-After; /healthz is never refused."""
    settings = make_settings(database_url, max_concurrent_requests=3)
    before = _refused("requests")
    async with serve(settings) as server, httpx.AsyncClient(timeout=10) as http:
        rpc = RpcSession(http, server.url)
        await rpc.initialize()
        calls = [
            asyncio.ensure_future(rpc.send("tools/call", {"name": "sleep", "arguments": {"seconds": 2}}))
            for _ in range(3)
        ]
        async with asyncio.timeout(5):
            while True:
                r = await http.post(server.url, content=PING, headers=rpc.headers())
                if r.status_code == 503:
                    break
                await asyncio.sleep(0.05)
        assert r.headers["retry-after"] == "1"
        assert _refused("requests") == before + 1
        assert (await http.get(server.url.replace("/mcp", "/healthz"))).status_code == 200
        for call in calls:
            assert "result" in await call
        assert "result" in await rpc.send("ping")


async def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(database_url: str) -> None:
    """Issue 14 §1: MCP_TASKS_HTTP_KEEPALIVE_TIMEOUT_S closes a connection idle between requests."""
    async with serve(make_settings(database_url, http_keepalive_timeout_s=1, http_header_timeout_s=30)) as server:
        async with raw_socket(server.url) as (reader, writer):
            writer.write(_healthz())
            await writer.drain()
            started = time.monotonic()
            response = await read_until_closed(reader, timeout_s=5)
        assert status_of(response) == 200
        assert 0.8 < time.monotonic() - started < 3


async def test_mcp_tasks_serve_itself_enforces_the_connection_limits(database_url: str) -> None:
    """Issue 14 §1 against the real `mcp-tasks serve` process (its own uvicorn configuration):
    an oversized header gets 431, sockets beyond MCP_TASKS_MAX_CONNECTIONS get 503 at once, idle
    ones are closed at the header timeout, and then the server serves again."""
    env = {"MCP_TASKS_HTTP_HEADER_TIMEOUT_S": "1", "MCP_TASKS_MAX_CONNECTIONS": "20",
           "MCP_TASKS_HTTP_MAX_HEADER_BYTES": "4096"}  # fmt: skip
    async with mcp_tasks("serve", database_url, **env) as (_, url):
        async with raw_socket(url) as (reader, writer):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 10_000)
            await writer.drain()
            assert status_of(await read_until_closed(reader, timeout_s=5)) == 431
        async with contextlib.AsyncExitStack() as flood:
            sockets = [await flood.enter_async_context(raw_socket(url)) for _ in range(25)]
            refused = await asyncio.gather(*(read_until_closed(r, timeout_s=1) for r, _ in sockets[20:]))
            assert [status_of(r) for r in refused] == [503] * 5
            timed_out = await asyncio.gather(*(read_until_closed(r, timeout_s=5) for r, _ in sockets[:20]))
            assert timed_out == [b""] * 20  # closed at the header timeout
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(url.replace("/mcp", "/healthz"))).status_code == 200


def _discover(request_id: int, extra_headers: bytes = b"") -> bytes:
    body = (
        b'{"jsonrpc":"2.0","id":%d,"method":"server/discover","params":{"_meta":{'
        b'"io.modelcontextprotocol/protocolVersion":"2026-07-28",'
        b'"io.modelcontextprotocol/clientCapabilities":{}}}}' % request_id
    )
    head = (
        b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2026-07-28\r\n"
        b"Mcp-Method: server/discover\r\nX-Request-Id: req-%d\r\n" % request_id
    )
    return head + extra_headers + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def _read_answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One response of known length: its status line, its headers (names lowercased), its body."""
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        status, *lines = head[:-4].split(b"\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(b":")
            assert name.lower() not in headers, f"{name!r} twice"
            headers[name.lower()] = value.strip()
        body = await reader.readexactly(int(headers[b"content-length"]))
    return status, headers, body


@pytest.fixture
def direct_answers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The statuses our server wrote through mcp.direct (one write per answer), in order."""
    written: list[int] = []
    respond = http_server._Direct.respond

    def counted(self: Any, request: Any, status: int, headers: Any, body: bytes) -> bool:
        done = respond(self, request, status, headers, body)
        if done:
            written.append(status)
        return done

    monkeypatch.setattr(http_server._Direct, "respond", counted)
    return written


async def test_a_json_answer_is_written_whole_and_the_connection_serves_the_next_request(
    database_url: str, direct_answers: list[int]
) -> None:
    """Our HTTP server writes a JSON answer at once (service/http_server.py, ``mcp.direct``): the
    status line, the server's and the endpoint's headers, a Content-Length that is the body's, and
    the connection kept for the next request; a request with ``Connection: close`` gets the same
    answer with ``connection: close``, and the socket is closed after it."""
    async with serve(make_settings(database_url)) as server, raw_socket(server.url) as (reader, writer):
        for request_id in (1, 2):  # one keep-alive connection, two answers
            writer.write(_discover(request_id))
            status, headers, body = await _read_answer(reader)
            assert status == b"HTTP/1.1 200 OK"
            assert headers[b"content-type"] == b"application/json"
            assert headers[b"x-request-id"] == b"req-%d" % request_id
            assert b"date" in headers
            assert b"connection" not in headers
            answer = json.loads(body)
            assert answer["id"] == request_id
            assert "io.modelcontextprotocol/tasks" in answer["result"]["capabilities"]["extensions"]
        writer.write(_discover(3, b"Connection: close\r\n"))
        status, headers, body = await _read_answer(reader)
        assert status == b"HTTP/1.1 200 OK"
        assert headers[b"connection"] == b"close"
        assert json.loads(body)["id"] == 3
        assert await read_until_closed(reader, timeout_s=5) == b""
    assert direct_answers == [200, 200, 200]  # each in one write, not through uvicorn's two sends


async def test_pipelined_requests_100_continue_and_http_1_0_are_answered_as_http_says(
    database_url: str, direct_answers: list[int]
) -> None:
    """The one-write answers keep HTTP/1.1's rules: requests pipelined in one write are answered
    in order; ``Expect: 100-continue`` gets its interim 100 before the answer; an HTTP/1.0 request
    gets ``connection: close`` and the socket is closed after its answer."""
    async with serve(make_settings(database_url)) as server:
        async with raw_socket(server.url) as (reader, writer):
            writer.write(_discover(1) + _discover(2) + _discover(3))
            ids = [json.loads((await _read_answer(reader))[2])["id"] for _ in range(3)]
            assert ids == [1, 2, 3]
        async with raw_socket(server.url) as (reader, writer):
            request = _discover(4, b"Expect: 100-continue\r\n")
            head, body = request.split(b"\r\n\r\n", 1)
            writer.write(head + b"\r\n\r\n")
            async with asyncio.timeout(5):
                assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(body)
            status, _, answer = await _read_answer(reader)
            assert status == b"HTTP/1.1 200 OK"
            assert json.loads(answer)["id"] == 4
        async with raw_socket(server.url) as (reader, writer):
            writer.write(_discover(5).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
            status, headers, answer = await _read_answer(reader)
            assert status == b"HTTP/1.1 200 OK"
            assert headers[b"connection"] == b"close"
            assert json.loads(answer)["id"] == 5
            assert await read_until_closed(reader, timeout_s=5) == b""
    assert direct_answers == [200] * 5
