"""Issue 44 §1: traces with the OpenTelemetry SDK, sent over OTLP/HTTP to a real receiver on a
loopback port (tests/otlp.py) by `serve` and `worker` processes: a task's whole life is one trace,
whichever process runs it; `params._meta.traceparent` is the parent; with no endpoint nothing is
exported and nothing of OpenTelemetry is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import http_client
from tests.ext import V2026Client
from tests.otlp import OtlpReceiver, Span, otlp_receiver, tracing_env
from tests.rpc import RpcSession
from tests.test_durability import ROOT, mcp_tasks
from tests.test_upstreams import upstreams_file

pytestmark = pytest.mark.slow


def one(spans: list[Span], what: str) -> Span:
    assert len(spans) == 1, (what, spans)
    return spans[0]


async def runs_of(receiver: OtlpReceiver, tool: str) -> Span:
    await receiver.wait_for(lambda: bool(receiver.named(f"execute_tool {tool}")))
    return one(receiver.named(f"execute_tool {tool}"), "run")


async def test_a_task_created_by_serve_and_run_by_a_worker_is_one_trace(database_url: str, tmp_path: Path) -> None:
    """Process A (serve, no runner) creates the task; process B (worker) runs it. B's run span is
    a child of A's tools/call span, in the same trace, with the run's events; the tasks/result
    that hands the result out links to that trace; A's log line of the create names the trace."""
    log = tmp_path / "serve.log"
    async with otlp_receiver() as receiver:
        env = tracing_env(receiver)
        async with mcp_tasks("serve", database_url, log, MCP_TASKS_RUNNER_CONCURRENCY="0", MCP_TASKS_LOG_LEVEL="INFO",
                             **env) as (_a, url), \
                mcp_tasks("worker", database_url, **env), http_client() as http:  # fmt: skip
            s = RpcSession(http, url)
            await s.initialize()
            task_id = (await s.call_tool_as_task("echo", {"text": "traced"}))["task"]["taskId"]
            result = await s.result("tasks/result", {"taskId": task_id})
            assert result["content"][0]["text"] == "traced"
            run = await runs_of(receiver, "echo")
            await receiver.wait_for(lambda: bool(receiver.named("tasks/result")))
            scraped = await http.get(url.removesuffix("/mcp") + "/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})  # fmt: skip
        create = one(receiver.named("tools/call echo"), "create")
        # OpenMetrics, asked for, carries the sampled requests' trace ids as latency exemplars.
        assert scraped.headers["content-type"].startswith("application/openmetrics-text")
        assert f'trace_id="{create.trace_id}"' in scraped.text
        assert (create.kind, create.resource["mcp_tasks.component"]) == ("server", "serve")
        assert create.attributes["mcp.method.name"] == "tools/call"
        assert create.attributes["gen_ai.tool.name"] == "echo"
        assert create.attributes["mcp.protocol.version"] == "2025-11-25"
        assert create.attributes["mcp_tasks.tenant.id"] == "local"
        assert len(create.attributes["mcp.session.id"]) == 16  # a hash of the session id, not the id
        assert (run.kind, run.resource["mcp_tasks.component"]) == ("consumer", "worker")
        assert (run.trace_id, run.parent_span_id) == (create.trace_id, create.span_id)
        assert run.attributes["mcp_tasks.task.id_prefix"] == task_id[:8]
        assert "task.tool_ended" in run.events
        batches = [b for b in receiver.named("batch create") if (create.trace_id, create.span_id) in b.links]
        assert len(batches) == 1  # the group-committed create that carried the request
        retrieve = one(receiver.named("tasks/result"), "retrieve")
        assert (create.trace_id, create.span_id) in retrieve.links
        assert task_id not in str([s.attributes for s in receiver.spans])  # only its prefix
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        create_line = next(e for e in lines if e.get("method") == "tools/call" and e.get("task") == task_id[:8])
        assert (create_line["trace_id"], create_line["span_id"]) == (create.trace_id, create.span_id)


async def test_a_2026_call_that_becomes_a_task_is_one_trace_with_its_run(database_url: str) -> None:
    """On 2026-07-28 the call itself becomes the task: with no runner in A it is queued at once, and
    B's run is the child of A's tools/call span."""
    async with otlp_receiver() as receiver:
        env = tracing_env(receiver)
        async with mcp_tasks("serve", database_url, MCP_TASKS_RUNNER_CONCURRENCY="0", **env) as (_a, url), \
                mcp_tasks("worker", database_url, **env), http_client() as http:  # fmt: skip
            m = V2026Client(http, url)
            created = await m.result("tools/call", {"name": "sleep", "arguments": {"seconds": 0.2}})
            assert created["resultType"] == "task"
            run = await runs_of(receiver, "sleep")
        call = one(receiver.named("tools/call sleep"), "call")
        assert call.attributes["mcp.protocol.version"] == "2026-07-28"
        assert (run.trace_id, run.parent_span_id) == (call.trace_id, call.span_id)
        assert run.resource["mcp_tasks.component"] == "worker"


async def test_a_traceparent_in_meta_is_the_parent_and_the_http_one_a_link(database_url: str) -> None:
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    http_trace, http_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    async with otlp_receiver() as receiver:
        async with mcp_tasks("serve", database_url, **tracing_env(receiver)) as (_a, url), http_client() as http:
            m = V2026Client(http, url)
            body = m.body("tools/call", {"name": "echo", "arguments": {"text": "hi"}},
                          traceparent=f"00-{client_trace}-{client_span}-01")  # fmt: skip
            headers = m.headers("tools/call", "echo", traceparent=f"00-{http_trace}-{http_span}-01")
            r = await m.post("tools/call", body=body, headers=headers)
            assert r.json()["result"]["content"][0]["text"] == "hi"
            await receiver.wait_for(lambda: bool(receiver.named("tools/call echo")))
        span = one(receiver.named("tools/call echo"), "call")
        assert (span.trace_id, span.parent_span_id) == (client_trace, client_span)
        assert span.links == [(http_trace, http_span)]
        assert span.attributes["jsonrpc.request.id"] == str(body["id"])


async def test_without_an_endpoint_nothing_is_exported(database_url: str) -> None:
    async with otlp_receiver() as receiver:
        # The receiver is up, but only the traces endpoint variable's absence matters: none is set.
        async with mcp_tasks("serve", database_url, OTEL_SERVICE_NAME="x") as (_a, url), http_client() as http:
            s = RpcSession(http, url)
            await s.initialize()
            task_id = (await s.call_tool_as_task("echo", {"text": "quiet"}))["task"]["taskId"]
            await s.result("tasks/result", {"taskId": task_id})
        assert (receiver.requests, receiver.spans) == (0, [])


def test_without_an_endpoint_opentelemetry_is_never_imported(database_url: str) -> None:
    """Tracing off: a server that runs a task's whole life never loads OpenTelemetry's SDK, exporter
    or protocol (FastAPI itself imports the OpenTelemetry API when it is installed; nothing of
    ours does)."""
    code = (
        "import asyncio, sys\n"
        "from tests.conftest import http_client, make_settings, serve\n"
        "from tests.rpc import RpcSession\n"
        "async def main():\n"
        f"    async with serve(make_settings({database_url!r})) as server, http_client() as http:\n"
        "        s = RpcSession(http, server.url)\n"
        "        await s.initialize()\n"
        "        task = await s.call_tool_as_task('echo', {'text': 'x'})\n"
        "        await s.result('tasks/result', {'taskId': task['task']['taskId']})\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter', "
        "'opentelemetry.proto', 'google.protobuf'))))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


async def test_an_unreachable_collector_costs_requests_nothing(database_url: str) -> None:
    """Spans are exported in the background: with the collector down the service answers as before."""
    async with mcp_tasks("serve", database_url, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
                         OTEL_TRACES_SAMPLER="always_on") as (_a, url), http_client() as http:  # fmt: skip
        s = RpcSession(http, url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("echo", {"text": "still"}))["task"]["taskId"]
        assert (await s.result("tasks/result", {"taskId": task_id}))["content"][0]["text"] == "still"
        r = await http.get(url.removesuffix("/mcp") + "/healthz")
        assert r.status_code == 200


async def test_an_upstream_call_carries_the_trace_to_the_upstream(
    tmp_path: Path, database_url: str, admin_dsn: str, template_db: str
) -> None:
    """Our run calls an upstream MCP server (this service again, on 2026-07-28): our client span is
    a child of the run, and the upstream's server span, in its own process, a child of that span
    (the context travels in the request's _meta)."""
    from tests.conftest import fresh_database

    async with otlp_receiver() as receiver, fresh_database(admin_dsn, template_db) as upstream_db:
        async with mcp_tasks("serve", upstream_db, **tracing_env(receiver, OTEL_SERVICE_NAME="upstream")) as (
            _u,
            upstream_url,
        ):
            body = f'[[upstream]]\nname = "ext"\nurl = "{upstream_url}"\ntools = ["echo"]\n'
            env = tracing_env(
                receiver, OTEL_SERVICE_NAME="front", MCP_TASKS_UPSTREAMS_FILE=upstreams_file(tmp_path, body)
            )
            async with mcp_tasks("serve", database_url, **env) as (_f, url), http_client() as http:
                s = RpcSession(http, url)
                await s.initialize()
                task_id = (await s.call_tool_as_task("ext.echo", {"text": "far"}))["task"]["taskId"]
                assert (await s.result("tasks/result", {"taskId": task_id}))["content"][0]["text"] == "far"
                await receiver.wait_for(lambda: any(x.resource["service.name"] == "upstream"
                                                    for x in receiver.named("tools/call echo")))  # fmt: skip
        run = one(receiver.named("execute_tool ext.echo"), "run")
        client = one([x for x in receiver.named("tools/call echo") if x.kind == "client"], "client")
        served = one([x for x in receiver.named("tools/call echo") if x.resource["service.name"] == "upstream"],
                     "upstream")  # fmt: skip
        assert (client.trace_id, client.parent_span_id) == (run.trace_id, run.span_id)
        assert (served.kind, served.trace_id, served.parent_span_id) == ("server", run.trace_id, client.span_id)


async def test_following_an_upstream_task_is_client_spans_that_carry_the_trace(
    tmp_path: Path, database_url: str
) -> None:
    """Our run follows a 2025-11-25 upstream task (the SDK's client): the tools/call that creates
    it, each tasks/get, the tasks/result and, for a cancelled task, the tasks/cancel are client spans,
    children of the run, and each request carries its own span's context in ``_meta``."""
    from tests.test_upstream_tasks import env_for, started, task_upstream
    from tests.test_upstreams import until

    marks = tmp_path / "marks"
    marks.mkdir()
    async with otlp_receiver() as receiver:
        with task_upstream(marks) as upstream:
            env = tracing_env(receiver, **env_for(tmp_path, upstream))
            async with mcp_tasks("serve", database_url, **env) as (_p, url), http_client() as http:
                s = RpcSession(http, url)
                await s.initialize()
                task_id = (await s.call_tool_as_task("tup.work", {"seconds": 0.6}))["task"]["taskId"]
                assert (await s.result("tasks/result", {"taskId": task_id}))["content"][0]["text"] == "worked 0.6s"
                long_id = (await s.call_tool_as_task("tup.work", {"seconds": 60}))["task"]["taskId"]

                async def two_started() -> bool:
                    return started(marks) >= 2

                await until(two_started)
                await s.result("tasks/cancel", {"taskId": long_id})
                await receiver.wait_for(lambda: any(x.kind == "client" for x in receiver.named("tasks/cancel")))
    runs = {(r.trace_id, r.span_id) for r in receiver.named("execute_tool tup.work")}
    assert len(runs) == 2, runs
    clients = [x for x in receiver.spans if x.kind == "client" and x.attributes.get("mcp_tasks.upstream") == "tup"]
    assert {x.attributes["mcp.method.name"] for x in clients} == {"tools/call", "tasks/get", "tasks/result",
                                                                    "tasks/cancel"}  # fmt: skip
    assert all((x.trace_id, x.parent_span_id) in runs for x in clients), clients
    carried = [line.split()[1] for line in (marks / "requests").read_text().splitlines()]
    assert "-" not in carried  # every request of ours carried a trace context
    received = {tuple(traceparent.split("-")[1:3]) for traceparent in carried}  # (trace id, span id)
    spans = {(x.trace_id, x.span_id) for x in clients}
    # Each request the upstream saw is one of those spans; at most one span's request did not get
    # there (the poll our cancel cut short).
    assert received <= spans, (spans, received)
    assert len(spans - received) <= 1, (spans, received)


async def test_the_default_sampler_keeps_about_one_task_in_ten_whole(database_url: str) -> None:
    """Parent-based 10 % (no OTEL_TRACES_SAMPLER): of 100 tasks some are traced and most not, and a
    task is traced whole or not at all: every run span has its creating request's span."""
    async with otlp_receiver() as receiver:
        env = {k: v for k, v in tracing_env(receiver).items() if k != "OTEL_TRACES_SAMPLER"}
        async with mcp_tasks("serve", database_url, **env) as (_a, url), http_client() as http:
            s = RpcSession(http, url)
            await s.initialize()
            for _ in range(100):
                task_id = (await s.call_tool_as_task("echo", {"text": "n"}))["task"]["taskId"]
                await s.result("tasks/result", {"taskId": task_id})
            unsampled = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"  # the client's: not sampled
            for _ in range(5):
                task_id = (await s.call_tool_as_task("echo", {"text": "n"}, _meta={"traceparent": unsampled}))["task"]
                await s.result("tasks/result", {"taskId": task_id["taskId"]})

            def whole() -> bool:
                runs = receiver.named("execute_tool echo")
                return bool(runs) and len(runs) == len(receiver.named("tools/call echo"))

            await receiver.wait_for(whole)
        creates = {(c.trace_id, c.span_id) for c in receiver.named("tools/call echo")}
        assert 1 <= len(creates) <= 30, len(creates)  # 100 x 10 %: 0 or over 30 is under 1e-4 likely
        assert {(r.trace_id, r.parent_span_id) for r in receiver.named("execute_tool echo")} == creates
        assert not [x for x in receiver.spans if x.trace_id == unsampled[3:35]]  # followed the client's "no"
