"""Structured logs: JSON lines with request id, tenant and method; never tokens or tool arguments."""

from __future__ import annotations

import io
import logging

import asyncpg
import httpx
import orjson
import pytest

from service.observability.logging import JsonFormatter
from tests.conftest import RunningServer, make_settings, serve
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
