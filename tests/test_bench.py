"""The load generator (``mcp-tasks bench``): short smoke runs against our real server, and its refusals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from service.bench import BenchConfig, BenchUsageError, main, run_bench, wire
from service.bench.report import advice, summary
from service.bench.sse import SseParser
from service.bench.stats import Recorder
from service.bench.v2026 import V2026Session, header_value
from service.bench.wire import McpSession, RequestFailed
from service.bench.workloads import Client, Workload
from tests.conftest import free_port, make_settings, serve

METHODS = {
    "plain": {"tools/call"},
    "lifecycle": {"tools/call", "tasks/get", "tasks/result"},
    "get": {"tasks/get"},
    "create": {"tools/call"},
    "ext-lifecycle": {"tools/call", "tasks/get"},
    "ext-get": {"tasks/get"},
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


@pytest.mark.parametrize("workload", ["ext-lifecycle", "ext-get"])
async def test_each_extension_workload_runs_without_errors_against_our_server(database_url: str, workload: str) -> None:
    # Grace 0, as make bench runs ours for these: every optional call becomes a task at once.
    async with serve(make_settings(database_url, task_grace_ms=0)) as server:
        result = await run_bench(smoke_config(server.url, workload))

    assert result["workload"] == workload
    assert result["wire"] == "2026-07-28"
    assert result["ops"] > 0
    assert result["errors"] == 0, result["error_kinds"]
    assert set(result["methods"]) == METHODS[workload]
    for stats in result["methods"].values():
        assert stats["count"] >= result["ops"]
        assert stats["errors"] == 0
        assert 0 < stats["p50_ms"] <= stats["p95_ms"] <= stats["p99_ms"]
    if workload == "ext-lifecycle":
        # One create per lifecycle, and at least one tasks/get that saw it completed.
        assert result["methods"]["tools/call"]["count"] == result["ops"]
        assert result["methods"]["tasks/get"]["count"] >= result["ops"]
    else:
        assert result["methods"]["tasks/get"]["count"] == result["ops"]
        assert result["cleanup"]["cancelled"] == 4 * 5  # clients x held, every one through tasks/cancel
    assert result["cleanup"]["failed"] == result["cleanup"]["left"] == 0


async def test_an_extension_call_answered_without_a_task_is_a_failed_lifecycle(database_url: str) -> None:
    # sleep(0) ends in its first loop turn: inside the default grace (and even with grace 0) ours
    # answers it synchronously, which is no task lifecycle at all.
    async with serve(make_settings(database_url, task_grace_ms=0)) as server:
        result = await run_bench(smoke_config(server.url, "ext-lifecycle", task_seconds=0.0, duration_s=0.5))

    assert result["attempted"] > 0
    assert result["ops"] == 0  # the headline counts successes only
    assert result["errors"] == result["attempted"]
    assert result["error_kinds"] == {"not_a_task": result["attempted"]}
    assert set(result["methods"]) == {"tools/call"}


@pytest.mark.parametrize("workload", ["plain", "lifecycle"])
async def test_every_failed_operation_is_counted_by_method_and_kind(database_url: str, workload: str) -> None:
    async with serve(make_settings(database_url)) as server:
        result = await run_bench(smoke_config(server.url, workload, tool="no_such_tool", duration_s=0.5))

    assert result["attempted"] > 0
    assert result["ops"] == 0
    assert result["throughput_per_s"] == 0.0
    assert result["errors"] == result["attempted"]
    assert sum(result["error_kinds"].values()) == result["attempted"]
    call = result["methods"]["tools/call"]
    assert call["count"] == call["errors"] == result["attempted"]
    assert call["p50_ms"] is None
    assert set(result["methods"]) == {"tools/call"}  # a failed create never reaches tasks/get


async def test_a_rate_limited_run_counts_only_successes_and_names_the_setting_to_raise(database_url: str) -> None:
    """Issue 15, point 4: against a server whose rate limit the load exceeds, the headline counts
    successful operations only, and the run says that errors dominate and what to raise or lower."""
    # 4 clients open their sessions (2 requests each), then the budget is spent within the warm-up.
    async with serve(make_settings(database_url, rate_limit="12/minute")) as server:
        result = await run_bench(smoke_config(server.url, "plain", duration_s=0.5))
    assert result["error_kinds"].get("http_429", 0) > 0
    call = result["methods"]["tools/call"]
    assert result["ops"] == call["count"] - call["errors"]  # successes only
    assert result["attempted"] == result["ops"] + result["errors"]
    assert result["throughput_per_s"] == pytest.approx(result["ops"] / result["duration_s"], abs=0.1)
    assert result["errors"] > result["ops"]
    assert any("MCP_TASKS_RATE_LIMIT" in line and "--clients" in line for line in result["advice"])
    text = summary(result)
    assert "errors dominate" in text
    assert "MCP_TASKS_RATE_LIMIT" in text
    assert f"{result['ops']} successful ops" in text


async def test_a_run_over_the_active_task_cap_names_the_caps_to_raise(database_url: str) -> None:
    """Issue 15, point 4: -32000 from the cap on active tasks per requestor (16 by default, 2 here)
    is named, with the settings to raise and the flag to lower."""
    async with serve(make_settings(database_url, max_active_tasks_per_requestor=2)) as server:
        result = await run_bench(smoke_config(server.url, "create", duration_s=0.5, max_ops=40))
    assert result["error_kinds"].get("rpc_-32000", 0) > 0
    assert result["ops"] <= 2  # at most the cap's worth of creates succeeded
    assert result["attempted"] == result["ops"] + result["errors"]
    assert any("MCP_TASKS_MAX_ACTIVE_TASKS_PER_REQUESTOR" in line and "--clients" in line for line in result["advice"])
    assert "errors dominate" in summary(result)


def test_a_clean_run_gives_no_advice_and_no_warning() -> None:
    result = {"workload": "get", "url": "http://127.0.0.1:1/mcp", "clients": 1, "duration_s": 1.0, "ops": 10,
              "attempted": 10, "errors": 0, "throughput_per_s": 10.0, "error_kinds": {}, "methods": {},
              "advice": advice({}, 10)}  # fmt: skip
    assert result["advice"] == []
    assert "WARNING" not in summary(result)
    assert "to fix" not in summary(result)
    few = {**result, "ops": 9, "errors": 1, "error_kinds": {"http_429": 1}, "advice": advice({"http_429": 1}, 10)}
    assert "WARNING" not in summary(few)  # 10 %: named, but not dominant
    assert "to fix: 1 requests refused with HTTP 429" in summary(few)


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


# A scripted answer: the raw pieces to write for one request (head and parsed body), and whether to close after.
Answer = Callable[[bytes, dict[str, Any]], tuple[list[bytes], bool]]


@dataclass
class ScriptedServer:
    """A tiny HTTP/1.1 server on loopback that answers every request with raw bytes from a script."""

    url: str
    connections: int = 0
    heads: list[bytes] = field(default_factory=list)


@contextlib.asynccontextmanager
async def scripted_server(answer: Answer) -> AsyncIterator[ScriptedServer]:
    handlers: set[asyncio.Task[Any]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        writers.append(writer)
        state.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                state.heads.append(head)
                pieces, close = answer(head, orjson.loads(body) if body else {})
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                if close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the client went away
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    state = ScriptedServer(url=f"http://127.0.0.1:{port}/mcp")
    try:
        yield state
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 5)
        await server.wait_closed()


def rpc_id_of(message: dict[str, Any]) -> bytes:
    return str(message["id"]).encode()


def chunked(*pieces: bytes) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces]


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


async def test_chunked_sse_answers_with_crlf_lines_and_notifications_first_keep_the_connection() -> None:
    # The SDK peers answer with sse-starlette: chunked, CRLF line ends, notifications before the response.
    def answer(head: bytes, message: dict[str, Any]) -> tuple[list[bytes], bool]:
        response = (
            b'event: message\r\ndata: {"jsonrpc":"2.0","id":' + rpc_id_of(message) + b',"result":{"ok":1}}\r\n\r\n'
        )
        events = [
            b": keepalive\r\n\r\n",
            b'event: message\r\ndata: {"jsonrpc":"2.0","method":"notifications/progress","params":{}}\r',
            b"\n\r\n" + response[:30],  # a CRLF and an event cut across chunks
            response[30:],
        ]
        # A chunk extension and a trailer field are legal and must be skipped.
        body = [b"3;name=value\r\n: k\r\n", *chunked(*events), b"0\r\nx-trailer: 1\r\n\r\n"]
        return [SSE_HEAD, *body], False

    async with scripted_server(answer) as server:
        session = McpSession(server.url, token="t0k")
        try:
            assert await session.request("tasks/get", {"taskId": "t"}) == {"ok": 1}
            assert await session.request("tasks/get", {"taskId": "t"}) == {"ok": 1}
        finally:
            await session.close()
    assert server.connections == session.connection.opened == 1
    assert server.heads[0].startswith(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nAuthorization: Bearer t0k\r\n" in server.heads[0]


async def test_connection_close_and_bodies_ending_with_the_connection_make_the_client_reconnect() -> None:
    def answer(head: bytes, message: dict[str, Any]) -> tuple[list[bytes], bool]:
        body = b'{"jsonrpc":"2.0","id":' + rpc_id_of(message) + b',"result":{"n":' + rpc_id_of(message) + b"}}"
        if message["id"] == 1:
            return [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)], True
        return [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + body], True  # framed by the close

    async with scripted_server(answer) as server:
        session = McpSession(server.url, token=None)
        try:
            assert await session.request("tools/call", {}) == {"n": 1}
            assert await session.request("tools/call", {}) == {"n": 2}
            assert await session.request("tools/call", {}) == {"n": 3}
        finally:
            await session.close()
    assert server.connections == session.connection.opened == 3


async def test_an_sse_stream_held_open_after_the_answer_costs_only_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wire, "SSE_DRAIN_S", 0.05)

    def answer(head: bytes, message: dict[str, Any]) -> tuple[list[bytes], bool]:
        event = b'data: {"jsonrpc":"2.0","id":' + rpc_id_of(message) + b',"result":{}}\n\n'
        return [SSE_HEAD, *chunked(event)], False  # no final chunk: the stream stays open

    async with scripted_server(answer) as server:
        session = McpSession(server.url, token=None)
        try:
            assert await session.request("tasks/result", {"taskId": "t"}) == {}
            assert await session.request("tasks/result", {"taskId": "t"}) == {}
        finally:
            await session.close()
    assert session.connection.opened == 2


async def test_error_statuses_and_rpc_errors_become_failure_kinds() -> None:
    def answer(head: bytes, message: dict[str, Any]) -> tuple[list[bytes], bool]:
        if message["method"] == "tasks/get":
            body = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"x"}}'
            return [b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)], False
        if message["method"] == "tasks/list":
            return [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"], True  # cut short
        if message["method"] == "tasks/cancel":
            return [b"SPDY/3 200 OK\r\n\r\n"], True
        body = b'{"jsonrpc":"2.0","id":' + rpc_id_of(message) + b',"error":{"code":-32602,"message":"x"}}'
        return [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)], False

    kinds = {}
    async with scripted_server(answer) as server:
        session = McpSession(server.url, token=None)
        try:
            for method in ("tasks/get", "tasks/result", "tasks/list", "tasks/cancel"):
                with pytest.raises(RequestFailed) as failure:
                    await session.request(method, {"taskId": "t"})
                kinds[method] = failure.value.kind
        finally:
            await session.close()
    assert kinds == {
        "tasks/get": "http_404",
        "tasks/result": "rpc_-32602",
        "tasks/list": "transport_ConnectionLost",
        "tasks/cancel": "transport_BadResponse",
    }


async def test_a_refused_connection_is_a_transport_failure() -> None:
    session = McpSession(f"http://127.0.0.1:{free_port()}/mcp", token=None)
    with pytest.raises(RequestFailed) as failure:
        await session.request("tools/call", {})
    await session.close()
    assert failure.value.kind == "transport_ConnectFailed"


def test_sse_events_are_the_same_however_the_stream_is_cut() -> None:
    stream = b': ping\r\n\r\nevent: message\r\ndata: {"a":1}\r\n\r\ndata: x\ndata: y\n\ndata:z\r\rdata: cut'
    whole = SseParser().feed(stream)
    parser = SseParser()
    one_by_one = [event for i in range(len(stream)) for event in parser.feed(stream[i : i + 1])]
    assert whole == one_by_one == [b'{"a":1}', b"x\ny", b"z"]


def _harness() -> Any:
    """bench/run.py (the side-by-side harness) as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "run.py"
    spec = importlib.util.spec_from_file_location("bench_run", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_run"] = module
    spec.loader.exec_module(module)
    return module


def _run(ops: float, cpu: float = 1.0, errors: int = 0, **server: float) -> dict[str, Any]:
    return {"throughput_per_s": ops, "errors": errors, "server": {"cpu_ms_per_op": cpu, **server}}


def test_the_report_judges_every_target_and_counts_failures_of_the_scale_run_too(tmp_path: Any) -> None:
    run = _harness()
    report = {
        "rounds": 1,
        "duration_s": 8.0,
        "results": {
            "plain": {"ours": [_run(5000, 0.2)], "sdk": [_run(600)], "fastmcp": [_run(650)], "floor": [_run(20000)]},
            "lifecycle": {
                "ours": [_run(500)],
                "sdk": [_run(200)],
                "fastmcp": [_run(100, errors=3) | {"error_kinds": {"rpc_-32602": 3}}],
            },
            "get": {"ours": [_run(3000)], "sdk": [_run(200)], "fastmcp": [_run(250)]},
            "create": {
                "ours": [_run(2500, rss_growth_kib_per_1000_pending=30)],
                "sdk": [_run(300)],
                "fastmcp": [_run(60)],
            },
            "ext-lifecycle": {
                "ours": [_run(600) | {"ops": 100, "methods": {"tasks/get": {"count": 150}}}],
                "fastmcp4": [
                    _run(100, errors=2)
                    | {"ops": 50, "methods": {"tasks/get": {"count": 100}}, "error_kinds": {"timeout": 2}}
                ],
            },
            "ext-get": {"ours": [_run(4000)], "fastmcp4": [_run(500)]},
        },
        "scale": {"1,000": {"p99_ms": 10.0, "errors": 0}, "1,000,000": {"p99_ms": 20.0, "errors": 2}},
    }
    text = run.render(report)
    verdict = {
        line.split(" | ")[0][2:]: line.split(" | ")[-1][:-2] for line in text.splitlines() if line.count("|") == 4
    }
    assert verdict["plain `tools/call` >= 5x best peer"] == "met"  # 5000 / 650 = 7.7x
    assert verdict["... with <= 0.35 ms server CPU per request"] == "met"
    assert verdict["plain `tools/call` >= 0.5x the bare Starlette floor"] == "**missed**"  # 0.25x
    assert verdict["task lifecycles/s >= 4x best peer"] == "**missed**"  # 2.5x
    assert verdict["task creates/s >= 8x best peer"] == "met"  # 2500 / 300 = 8.3x
    assert verdict["`tasks/get` >= 25x best peer, 6,400 held"] == "**missed**"  # 3000 / 250 = 12x
    assert verdict["`tasks/get` p99 within 1.5x from 1 thousand to 1 million stored"] == "**missed**"  # 2x
    assert verdict["zero failed operations (ours, every run)"] == "**missed**"  # the scale run's 2
    assert "| plain | 5000 | 600 | 650 | 20000 | 7.69x | 0.25x | >= 5x |" in text
    assert "- fastmcp lifecycle: 3 rpc_-32602 failed operations over 1 runs." in text
    # The extension workloads: against the fastmcp-tasks peer only, in a table of their own.
    assert verdict["extension task lifecycles/s >= 5x fastmcp-tasks"] == "met"  # 6x
    assert verdict["extension `tasks/get` >= 10x fastmcp-tasks, 6,400 held"] == "**missed**"  # 8x
    assert "| ext-lifecycle | 600 | 100 | 6.00x | >= 5x |" in text
    assert "| ext-get | 4000 | 500 | 8.00x | >= 10x |" in text
    assert "(at once, then every 5 ms; medians): ours 1.50, fastmcp-tasks 2.00" in text
    assert "- ext-get: 4000 / 500" in text
    assert "| ext-get | 1.000 + - | 1.000 |" in text
    assert "- fastmcp4 ext-lifecycle: 2 timeout failed operations over 1 runs." in text
    assert "| ext-lifecycle |" not in text.split("2026-07-28 Tasks extension")[0]  # not in the 2025-11-25 table

    doc = tmp_path / "performance.md"
    doc.write_text(f"# Performance\n\nkept\n\n{run.BEGIN}\nold numbers\n{run.END}\n\nalso kept\n")
    run.write_doc(doc, report)
    written = doc.read_text()
    assert "old numbers" not in written
    assert written.startswith("# Performance\n\nkept\n\n")
    assert written.endswith(f"{run.END}\n\nalso kept\n")
    assert "| task lifecycles/s >= 4x best peer | 2.50x | **missed** |" in written


def test_the_report_sets_one_principal_against_the_spread_load_and_names_the_machine(tmp_path: Any) -> None:
    """Issue 15, point 3: the one-principal variants are judged against the spread runs of the
    same report (>= 0.9x, the worst of them counts), and the report names the machine."""
    run = _harness()
    assert run.WORKLOADS["get-1p"] == {**run.WORKLOADS["get"], "base": "get", "principals": 1}
    assert run.peers_of("lifecycle-1p") == ()
    report = {
        "rounds": 1,
        "duration_s": 8.0,
        "machine": {"cpu_model": "Test CPU 3000", "cores": 2, "memory_gib": 23.5},
        "results": {
            # The server core's busy share: our CPU seconds plus PostgreSQL's over the measured 8 s.
            "get": {"ours": [_run(1000, cpu_s=7.0) | {"ops": 8000, "duration_s": 8.0, "db_cpu_ms_per_op": 0.1}]},
            "get-1p": {"ours": [_run(950, cpu_s=6.0) | {"ops": 7600, "duration_s": 8.0, "db_cpu_ms_per_op": 0.1}]},
            "create": {"ours": [_run(400)]},
            "create-1p": {"ours": [_run(300, errors=1)]},
        },
        "scale": {},
    }
    text = run.render(report)
    assert "| get | 1000 | 950 | 0.95x | 0.95 |" in text
    assert "| create | 400 | 300 | 0.75x | 0.75 |" in text
    assert "| one principal >= 0.9x the spread load (get, create; worst) | 0.75x | **missed** |" in text
    assert "| 98 % / 84 % |" in text  # (7 + 0.8) / 8 and (6 + 0.76) / 8; create measured none
    assert "| ... with the server core >= 90 % busy in both (least busy median) | 84 % | **missed** |" in text
    assert "| get-1p |" not in text  # not a workload of the peers' tables
    assert "| zero failed operations (ours, every run) | 1 | **missed** |" in text  # the variants' failures count
    doc = tmp_path / "performance.md"
    doc.write_text(f"{run.BEGIN}\n{run.END}\n")
    run.write_doc(doc, report)
    assert "on Test CPU 3000, 2 cores, 23.5 GiB._" in doc.read_text()
    machine = run.machine()
    assert machine["cores"] >= 1
    assert machine["cpu_model"]


def test_a_one_principal_run_follows_its_spread_run_and_is_judged_against_it_round_by_round() -> None:
    """The machine's speed drifts by 20-30 % over minutes: each one-principal run goes right after
    ours' spread run of the same round, and the verdict is the median of the rounds' own ratios
    (the ratio of the two medians would set runs of different rounds against each other)."""
    run = _harness()
    order = run.schedule(["get", "create", "get-1p"], ["sdk"], 2, None)
    assert order == [
        (0, "get", "ours"), (0, "get-1p", "ours"), (0, "get", "sdk"), (0, "create", "ours"), (0, "create", "sdk"),
        (1, "get", "sdk"), (1, "get", "ours"), (1, "get-1p", "ours"), (1, "create", "sdk"), (1, "create", "ours"),
    ]  # fmt: skip
    assert run.schedule(["get-1p"], [], 1, None) == [(0, "get-1p", "ours")]  # alone: as any workload
    report = {
        "results": {
            "get": {"ours": [_run(1000), _run(2000), _run(1500)]},
            "get-1p": {"ours": [_run(950), _run(1800), _run(1500)]},
        }
    }
    # Per round 0.95, 0.90, 1.00: the median is 0.95 (the medians' ratio, 1500 / 1500, would be 1.00).
    assert run.one_principal_ratios(report) == {"get-1p": ("get", 0.95)}


EXT = "io.modelcontextprotocol/tasks"


def _json_answer(status: int, message: dict[str, Any]) -> list[bytes]:
    body = orjson.dumps(message)
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}[status]
    return [
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (status, reason, len(body), body)
    ]


def _modern_peer(final_text: str, polls_working: int = 1) -> Answer:
    """A scripted 2026-07-28 server: discover, tools/call -> a task, tasks/get working then completed."""
    gets: dict[str, int] = {}

    def answer(head: bytes, message: dict[str, Any]) -> tuple[list[bytes], bool]:
        method, params = message["method"], message["params"]
        if method == "server/discover":
            result: dict[str, Any] = {"resultType": "complete", "capabilities": {"extensions": {EXT: {}}}}
        elif method == "tools/call":
            result = {"resultType": "task", "taskId": "t-1", "status": "working", "pollIntervalMs": 5000}
        elif method == "tasks/get" and params["taskId"] == "t-1":
            gets["t-1"] = gets.get("t-1", 0) + 1
            done = gets["t-1"] > polls_working
            result = {"resultType": "complete", "taskId": "t-1", "status": "completed" if done else "working"}
            if done:
                result["result"] = {"content": [{"type": "text", "text": final_text}]}
        else:
            error = {"code": -32602, "message": "no such task"}
            return _json_answer(400, {"jsonrpc": "2.0", "id": message["id"], "error": error}), False
        return _json_answer(200, {"jsonrpc": "2.0", "id": message["id"], "result": result}), False

    return answer


def _ext_client(url: str) -> Client:
    return Client(V2026Session(url, token="t0k"), random.Random(0))


async def test_the_extension_client_sends_meta_and_routing_headers_on_every_request() -> None:
    bodies: list[dict[str, Any]] = []
    peer = _modern_peer("slept 0.001s", polls_working=2)

    def answer(head: bytes, message: dict[str, Any]) -> tuple[list[bytes], bool]:
        bodies.append(message)
        return peer(head, message)

    workload = Workload.build("ext-lifecycle", "echo", "sleep", 1000, task_seconds=0.001, poll_ms=1)
    rec = Recorder()
    async with scripted_server(answer) as server:
        client = _ext_client(server.url)
        try:
            await client.session.initialize()
            assert await workload.ext_lifecycle(client, rec) is True
        finally:
            await client.session.close()
    assert server.connections == 1
    assert [b["method"] for b in bodies] == ["server/discover", "tools/call", "tasks/get", "tasks/get", "tasks/get"]
    meta = {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {"extensions": {EXT: {}}},
    }
    assert all(b["params"]["_meta"] == meta for b in bodies)
    assert bodies[1]["params"] == {"name": "sleep", "arguments": {"seconds": 0.001}, "_meta": meta}  # no params.task
    heads = [h.decode() for h in server.heads]
    assert all("\r\nMCP-Protocol-Version: 2026-07-28\r\n" in h for h in heads)
    assert all("\r\nAuthorization: Bearer t0k\r\n" in h for h in heads)
    assert "\r\nMcp-Method: server/discover\r\n" in heads[0]
    assert "Mcp-Name" not in heads[0]
    assert "\r\nMcp-Method: tools/call\r\nMcp-Name: sleep\r\n" in heads[1]
    assert all("\r\nMcp-Method: tasks/get\r\nMcp-Name: t-1\r\n" in h for h in heads[2:])
    assert rec.kinds == {}
    assert rec.successes("tasks/get") == 3


async def test_an_extension_lifecycle_fails_on_a_wrong_result_text_and_error_bodies_give_their_code() -> None:
    workload = Workload.build("ext-lifecycle", "echo", "sleep", 1000, task_seconds=0.001, poll_ms=0)
    rec = Recorder()
    async with scripted_server(_modern_peer("slept 1s")) as server:
        client = _ext_client(server.url)
        try:
            assert await workload.ext_lifecycle(client, rec) is False
            with pytest.raises(RequestFailed) as failure:
                await client.session.request("tasks/cancel", {"taskId": "other"})
        finally:
            await client.session.close()
    assert rec.kinds == {"wrong_result": 1}
    assert failure.value.kind == "rpc_-32602"


def test_header_values_outside_printable_ascii_use_the_base64_form() -> None:
    assert header_value("tk_abc-DEF") == "tk_abc-DEF"
    assert header_value("grüße") == "=?base64?Z3LDvMOfZQ==?="


def test_the_report_sets_the_upstream_hop_against_the_local_lifecycle_of_the_same_rounds() -> None:
    """Issue 41: lifecycles of an upstream's echo tool against ours' own echo, round by round, and
    the p50 the hop adds, each judged (>= 0.5x, <= 5 ms)."""
    run = _harness()
    assert run.WORKLOADS["lifecycle-up"] == {**run.WORKLOADS["lifecycle"], "base": "lifecycle", "tool": "up.echo"}
    assert run.peers_of("lifecycle-up") == ()
    latency = {"p50_ms": 10.0, "p99_ms": 30.0}
    report = {
        "rounds": 2,
        "duration_s": 8.0,
        "results": {
            "lifecycle": {"ours": [_run(1000) | {"op_latency": latency}, _run(800) | {"op_latency": latency}]},
            "lifecycle-up": {
                "ours": [
                    _run(600) | {"op_latency": {"p50_ms": 13.0, "p99_ms": 40.0}, "upstream_cpu_ms_per_op": 3.0},
                    _run(400) | {"op_latency": {"p50_ms": 15.0, "p99_ms": 50.0}, "upstream_cpu_ms_per_op": 5.0},
                ]
            },
        },
        "scale": {},
    }
    text = run.render(report)
    assert "| lifecycles/s | 900 | 500 | 0.55x |" in text  # the rounds' ratios 0.6 and 0.5
    assert "| p50, ms | 10.0 | 14.0 | +4.0 |" in text
    assert "| upstream lifecycles/s >= 0.5x local (median of the rounds' ratios) | 0.55x | met |" in text
    assert "| ... adding <= 5 ms p50 | 4.0 ms | met |" in text
    # Where the CPU went, each core's tenants: the upstream's process shares the load core.
    assert "| CPU per lifecycle, ms: the load generator + the upstream's process (load core) | " in text
    assert "+ 4.00 | |" in text
    assert "| lifecycle-up |" not in text  # not a workload of the peers' tables


def test_the_report_sets_tracing_on_against_off_in_the_same_rounds() -> None:
    """Issue 44: lifecycles with tracing on (the default sampler) against off, round by round,
    judged (>= 0.95x: tracing costs at most 5 %)."""
    run = _harness()
    assert run.WORKLOADS["lifecycle-traced"] == {**run.WORKLOADS["lifecycle"], "base": "lifecycle"}
    assert run.peers_of("lifecycle-traced") == ()
    report = {
        "rounds": 2,
        "duration_s": 8.0,
        "results": {
            "lifecycle": {"ours": [_run(1000), _run(800)]},
            "lifecycle-traced": {"ours": [_run(990), _run(776)]},
        },
        "scale": {},
    }
    text = run.render(report)
    assert "883 against 900 lifecycles/s, 0.98x (median of the rounds' ratios)" in text  # 0.99 and 0.97
    assert "| lifecycles/s with tracing on >= 0.95x off (median of the rounds' ratios) | 0.98x | met |" in text
    assert "| lifecycle-traced |" not in text
