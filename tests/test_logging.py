"""Structured logs: JSON lines with request id, tenant and method; never tokens or tool arguments."""

from __future__ import annotations

import asyncio
import io
import logging

import asyncpg
import httpx
import orjson
import pytest

from service.observability.logging import JsonFormatter
from tests.conftest import RunningServer, http_client, make_settings, serve
from tests.rpc import RpcSession


@pytest.fixture
def json_log() -> io.StringIO:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    yield stream
    root.removeHandler(handler)
    root.setLevel(old_level)


async def test_request_lines_are_json_with_request_id_tenant_and_method(
    server: RunningServer, http: httpx.AsyncClient, json_log: io.StringIO
) -> None:
    s = RpcSession(http, server.url)
    await s.initialize()
    secret_argument = "do-not-log-this-argument-value"
    r = await http.post(
        server.url,
        json=s.message("tools/call", {"name": "echo", "arguments": {"text": secret_argument}}),
        headers=s.headers(**{"X-Request-Id": "req-123"}),
    )
    assert r.headers["x-request-id"] == "req-123"
    lines = [orjson.loads(line) for line in json_log.getvalue().splitlines()]
    mine = [e for e in lines if e.get("request_id") == "req-123" and e["logger"] == "service.mcp.endpoint"]
    assert mine, lines
    entry = mine[-1]
    assert entry["tenant"] == "local"
    assert entry["method"] == "tools/call"
    assert entry["status"] == 200
    assert {"time", "level", "message", "duration_ms"} <= entry.keys()
    assert secret_argument not in json_log.getvalue()


def test_the_text_format_escapes_control_characters_so_no_line_is_forged() -> None:
    import logging

    from service.observability.logging import TextFormatter

    record = logging.LogRecord("service", logging.INFO, __file__, 1, "sub=%s", ("alice\n2026 ERROR forged",), None)
    line = TextFormatter("%(levelname)s %(message)s").format(record)
    assert "\n" not in line
    assert "alice\\x0a2026 ERROR forged" in line


async def test_a_server_with_autovacuum_off_is_named_at_start(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Without vacuum the task and audit tables bloat and latency grows with uptime (the soak showed
    it on a server with autovacuum off): serve says so once at start, and only then."""
    conn = await asyncpg.connect(database_url)
    try:
        autovacuum = await conn.fetchval("SELECT current_setting('autovacuum')")
    finally:
        await conn.close()
    with caplog.at_level(logging.WARNING, logger="service.core"):
        async with serve(make_settings(database_url)):
            pass
    warned = [r for r in caplog.records if "autovacuum off" in r.getMessage()]
    assert len(warned) == (1 if autovacuum != "on" else 0)


def entries(log: io.StringIO) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in log.getvalue().splitlines()]


async def test_a_tasks_lines_name_its_request_wire_principal_tool_and_task_prefix(
    server: RunningServer, http: httpx.AsyncClient, json_log: io.StringIO
) -> None:
    """Issue 44 §2: the create's request line and the tool's own line inside the run carry the
    wire, tenant, subject, tool and the task id's first 8 characters (never the whole id: it is a
    bearer handle, X-SEC-7); the run's line keeps the creating request's id."""
    s = RpcSession(http, server.url)
    await s.initialize()
    r = await http.post(
        server.url,
        json=s.message("tools/call", {"name": "log_line", "arguments": {"text": "hello"}, "task": {}}),
        headers=s.headers(**{"X-Request-Id": "req-task-1"}),
    )
    task_id = r.json()["result"]["task"]["taskId"]
    async with asyncio.timeout(10):
        while not any(e.get("logger") == "tests.toolpack" for e in entries(json_log)):
            await asyncio.sleep(0.02)
    lines = entries(json_log)
    request_line = next(
        e for e in lines if e.get("request_id") == "req-task-1" and e["logger"] == "service.mcp.endpoint"
    )
    tool_line = next(e for e in lines if e["logger"] == "tests.toolpack")
    about = {"wire": "2025-11-25", "tenant": "local", "subject": "local", "tool": "log_line", "task": task_id[:8]}
    assert {k: request_line.get(k) for k in about} == about
    assert {k: tool_line.get(k) for k in about} == about
    assert tool_line["request_id"] == "req-task-1"
    assert task_id not in json_log.getvalue()


async def test_the_2026_wire_and_a_task_request_are_named(
    server: RunningServer, http: httpx.AsyncClient, json_log: io.StringIO
) -> None:
    from tests.ext import V2026Client

    m = V2026Client(http, server.url)
    created = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 30}})
    assert created["resultType"] == "task"
    await m.result("tasks/cancel", {"taskId": created["taskId"]})
    lines = [e for e in entries(json_log) if e["logger"] == "service.mcp.endpoint"]
    call, cancel = lines[-2], lines[-1]
    assert (call["wire"], call["method"], call["tool"], call["task"]) == (
        "2026-07-28",
        "tools/call",
        "sleep",
        created["taskId"][:8],
    )
    assert (cancel["method"], cancel["task"], cancel["subject"]) == ("tasks/cancel", created["taskId"][:8], "local")


async def test_refusals_under_a_flood_are_counted_and_logged_once_per_principal_per_interval(
    database_url: str, json_log: io.StringIO
) -> None:
    """A flood refused by the rate limit was one INFO line per request (32,000 in 20 s). Now every
    refusal is counted and the principal's refused requests get one line per interval."""
    async with serve(make_settings(database_url, rate_limit="5/minute")) as server, http_client() as http:
        s = RpcSession(http, server.url)
        await s.initialize()
        statuses = [
            (await http.post(server.url, json=s.message("ping"), headers=s.headers())).status_code for _ in range(40)
        ]
        metrics = (await http.get(server.url.removesuffix("/mcp") + "/metrics")).text
    refused = statuses.count(429)
    assert refused >= 30, statuses
    lines = [e for e in entries(json_log) if e["logger"] == "service.mcp.endpoint" and e.get("status") == 429]
    assert len(lines) == 1, lines
    assert lines[0]["tenant"] == "local"
    counted = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("mcp_tasks_rate_limited_total{")
    )
    assert counted >= refused
