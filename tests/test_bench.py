"""The load generator (``mcp-tasks bench``): short smoke runs against our real server, and its refusals."""

from __future__ import annotations

import os

import httpx
import orjson
import pytest

from service.bench import BenchConfig, BenchUsageError, main, run_bench
from service.bench.wire import McpSession, RequestFailed
from tests.conftest import make_settings, serve

METHODS = {
    "plain": {"tools/call"},
    "lifecycle": {"tools/call", "tasks/get", "tasks/result"},
    "get": {"tasks/get"},
    "create": {"tools/call"},
}


def smoke_config(url: str, workload: str, **overrides: object) -> BenchConfig:
    values: dict[str, object] = {
        "url": url,
        "workload": workload,
        "clients": 4,
        "duration_s": 1.0,
        "warmup_s": 0.2,
        "held": 5,
        "server_pid": os.getpid(),  # the server runs in this process
        "progress": False,
    }
    values.update(overrides)
    return BenchConfig(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("workload", ["plain", "lifecycle", "get", "create"])
async def test_each_workload_runs_without_errors_against_our_server(database_url: str, workload: str) -> None:
    # max_ops bounds how many sleeping tasks "create" piles up; the other workloads run for the duration.
    max_ops = 150 if workload == "create" else None
    async with serve(make_settings(database_url)) as server:
        result = await run_bench(smoke_config(server.url, workload, max_ops=max_ops))

    assert result["workload"] == workload
    assert result["ops"] > 0
    assert result["errors"] == 0, result["error_kinds"]
    assert result["error_kinds"] == {}
    assert result["throughput_per_s"] > 0
    assert set(result["methods"]) == METHODS[workload]
    for stats in result["methods"].values():
        assert stats["count"] >= result["ops"]
        assert stats["errors"] == 0
        assert 0 < stats["p50_ms"] <= stats["p95_ms"] <= stats["p99_ms"]
    server_stats = result["server"]
    assert server_stats is not None
    assert server_stats["cpu_s"] >= 0
    assert server_stats["rss_start_mib"] > 0
    assert server_stats["rss_peak_mib"] >= server_stats["rss_end_mib"] > 0
    if workload == "create":
        assert result["ops"] <= 150
        assert server_stats["pending_created"] == result["ops"]
        assert server_stats["rss_growth_kib_per_1000_pending"] is not None
    else:
        assert server_stats["rss_growth_kib_per_1000_pending"] is None
    assert result["cleanup"]["failed"] == result["cleanup"]["left"] == 0
    if workload in ("get", "create"):
        assert result["cleanup"]["cancelled"] > 0


@pytest.mark.parametrize("workload", ["plain", "lifecycle"])
async def test_every_failed_operation_is_counted_by_method_and_kind(database_url: str, workload: str) -> None:
    async with serve(make_settings(database_url)) as server:
        result = await run_bench(smoke_config(server.url, workload, tool="no_such_tool", duration_s=0.5))

    assert result["ops"] > 0
    assert result["errors"] == result["ops"]
    assert sum(result["error_kinds"].values()) == result["ops"]
    call = result["methods"]["tools/call"]
    assert call["count"] == call["errors"] == result["ops"]
    assert call["p50_ms"] is None
    assert set(result["methods"]) == {"tools/call"}  # a failed create never reaches tasks/get


async def test_max_ops_stops_the_measured_phase_at_that_count(database_url: str) -> None:
    async with serve(make_settings(database_url)) as server:
        result = await run_bench(smoke_config(server.url, "plain", duration_s=60.0, max_ops=40, server_pid=None))

    assert result["ops"] == 40
    assert result["methods"]["tools/call"]["count"] == 40
    assert result["server"] is None


async def test_a_non_loopback_url_is_refused_without_allow_remote() -> None:
    with pytest.raises(BenchUsageError):
        await run_bench(BenchConfig(url="http://192.0.2.10:8000/mcp", workload="plain", progress=False))
    with pytest.raises(BenchUsageError):
        await run_bench(BenchConfig(url="http://example.com/mcp", workload="plain", progress=False))


def test_cli_exits_2_on_bad_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workload", "plain", "--url", "http://192.0.2.10/mcp", "--quiet"]) == 2
    assert main(["--workload", "nonsense"]) == 2
    assert main(["--workload", "plain", "--clients", "0"]) == 2
    assert capsys.readouterr().out == ""


async def test_sse_answers_with_crlf_lines_and_notifications_first_are_parsed() -> None:
    # The SDK peers answer with sse-starlette: CRLF line ends, progress notifications before the response.
    def answer(request: httpx.Request) -> httpx.Response:
        rpc_id = orjson.loads(request.content)["id"]
        events = [
            b": keepalive\r\n\r\n",
            b'event: message\r\ndata: {"jsonrpc":"2.0","method":"notifications/progress","params":{}}\r\n\r\n',
            b'event: message\r\ndata: {"jsonrpc":"2.0","id":' + str(rpc_id).encode() + b',"result":{"ok":1}}\r\n\r\n',
        ]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(events))

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        session = McpSession(http, "http://127.0.0.1/mcp", token=None)
        assert await session.request("tasks/get", {"taskId": "t"}) == {"ok": 1}


async def test_error_statuses_and_rpc_errors_become_failure_kinds() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        method = orjson.loads(request.content)["method"]
        if method == "tasks/get":
            return httpx.Response(404, json={"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "x"}})
        return httpx.Response(200, json={"jsonrpc": "2.0", "id": 2, "error": {"code": -32602, "message": "x"}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        session = McpSession(http, "http://127.0.0.1/mcp", token=None)
        with pytest.raises(RequestFailed) as status:
            await session.request("tasks/get", {"taskId": "t"})
        with pytest.raises(RequestFailed) as rpc:
            await session.request("tasks/result", {"taskId": "t"})
    assert status.value.kind == "http_404"
    assert rpc.value.kind == "rpc_-32602"
