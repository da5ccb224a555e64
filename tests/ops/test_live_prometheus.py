"""Live: a real Prometheus scrapes a real `mcp-tasks serve` (hosted, two tenants) and a worker under a
mixed load; every dashboard query must return data and every rule must parse and evaluate.

Loopback only, bounded (about a minute), and it cleans up its processes and its database.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import yaml

from service.auth.dev_issuer_cli import request_token
from service.store import migrate
from tests.conftest import free_port
from tests.ext import V2026Client
from tests.ops.conftest import ROOT, tool
from tests.ops.dashboards import panel_queries
from tests.rpc import RpcSession

RULES = ROOT / "grafana" / "alerts" / "mcp-tasks.rules.yaml"
# Grafana's variables, as a dashboard would send them over this short run.
VARIABLES = {"$__rate_interval": "5m", "$__range": "5m", "$tenant": "acme"}
# Panels whose metric is defined in service/observability/metrics.py but not fed yet (none now:
# the sweeper sets the queue and per-tenant gauges). Each must still parse.
NOT_FED: dict[str, str] = {}
DEADLINE_S = 150
MCP_TASKS = str(Path(sys.executable).parent / "mcp-tasks")


@dataclass
class Stack:
    work: Path
    env: dict[str, str]
    url: str
    issuer: str
    serve_metrics: str
    worker_metrics: str
    prometheus: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.work / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                args, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.work
            )

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.work.glob("*.log"))
        )


async def _admin(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 30, *, answered: bool = False) -> None:
    """Until ``url`` answers 200 (``answered``: anything; an MCP endpoint answers a bare GET 4xx)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            status = httpx.get(url, timeout=2).status_code
            if answered or status == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready in {timeout}s")


@pytest.fixture
def stack(admin_dsn: str) -> Iterator[Stack]:
    db_name = f"mcp_tasks_ops_{secrets.token_hex(4)}"
    asyncio.run(_admin(admin_dsn, f'CREATE DATABASE "{db_name}"'))
    work = Path(tempfile.mkdtemp(prefix="mcp-tasks-live-", dir="/var/tmp"))
    ports = {k: free_port() for k in ("issuer", "serve", "serve_metrics", "worker_metrics", "prometheus", "upstream")}
    url = f"http://127.0.0.1:{ports['serve']}/mcp"
    issuer = f"http://127.0.0.1:{ports['issuer']}"
    database_url = admin_dsn.rsplit("/", 1)[0] + "/" + db_name
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCP_TASKS_", "PROMETHEUS_MULTIPROC"))}
    env.update(
        MCP_TASKS_DATABASE_URL=database_url, MCP_TASKS_DATA_DIR=str(work / "data"), MCP_TASKS_OAUTH_ISSUER=issuer,
        MCP_TASKS_PUBLIC_URL=url, MCP_TASKS_PORT=str(ports["serve"]), MCP_TASKS_METRICS_TENANT_LABEL="true",
        MCP_TASKS_SWEEP_INTERVAL_MS="300", MCP_TASKS_LEASE_MS="3000", MCP_TASKS_RATE_LIMIT="100/minute",
        MCP_TASKS_MAX_ACTIVE_TASKS_PER_REQUESTOR="4", MCP_TASKS_LOG_LEVEL="WARNING", MCP_TASKS_SHUTDOWN_GRACE_S="1",
        MCP_TASKS_UPSTREAMS_FILE=str(work / "upstreams.toml"),
    )  # fmt: skip
    # An upstream MCP server (the tests' FastMCP one) whose tools both processes follow.
    (work / "upstreams.toml").write_text(
        f'[[upstream]]\nname = "up"\nurl = "http://127.0.0.1:{ports["upstream"]}/mcp"\n'
    )
    s = Stack(
        work, env, url, issuer,
        serve_metrics=f"http://127.0.0.1:{ports['serve_metrics']}",
        worker_metrics=f"http://127.0.0.1:{ports['worker_metrics']}",
        prometheus=f"http://127.0.0.1:{ports['prometheus']}",
    )  # fmt: skip
    try:
        migrate.upgrade(database_url)
        s.start("upstream", [sys.executable, "-m", "tests.upstream_server", "http", str(ports["upstream"])],
                {**env, "PYTHONPATH": str(ROOT)})  # fmt: skip
        _wait_http(f"http://127.0.0.1:{ports['upstream']}/mcp", s.procs["upstream"], answered=True)
        s.start("issuer", [MCP_TASKS, "dev-issuer", "--port", str(ports["issuer"]), "--ephemeral", "--audience", url])
        _wait_http(f"{issuer}/.well-known/oauth-authorization-server", s.procs["issuer"])
        # serve answers and sweeps; the worker runs every task (so killing it loses leases).
        s.start("serve", [MCP_TASKS, "serve"], {**env, "MCP_TASKS_RUNNER_CONCURRENCY": "0",
                                                "MCP_TASKS_METRICS_PORT": str(ports["serve_metrics"])})  # fmt: skip
        s.env = {**env, "MCP_TASKS_RUNNER_CONCURRENCY": "8", "MCP_TASKS_METRICS_PORT": str(ports["worker_metrics"])}
        s.start("worker", [MCP_TASKS, "worker"])
        _wait_http(s.serve_metrics + "/readyz", s.procs["serve"])
        _wait_http(s.worker_metrics + "/readyz", s.procs["worker"])
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "mcp-tasks", "static_configs": [{"targets": [s.serve_metrics[7:], s.worker_metrics[7:]]}]}
            ],
        }
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        s.start("prometheus", [
            tool("prometheus"), f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{ports['prometheus']}", "--log.level=warn",
        ])  # fmt: skip
        _wait_http(s.prometheus + "/-/ready", s.procs["prometheus"])
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        for name in list(s.procs):
            s.stop(name)
        asyncio.run(_admin(admin_dsn, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)'))
        shutil.rmtree(work, ignore_errors=True)


@contextlib.asynccontextmanager
async def _session(
    http: httpx.AsyncClient, s: Stack, tenant: str, subject: str, version: str = "2025-11-25"
) -> AsyncIterator[RpcSession]:
    token = await asyncio.to_thread(
        request_token, s.issuer, tenant=tenant, subject=subject, scope="tasks", resource=s.url
    )
    rpc = RpcSession(http, s.url, token=token)
    await rpc.initialize(version)
    yield rpc


async def _status(rpc: RpcSession, task_id: str) -> str:
    return str((await rpc.result("tasks/get", {"taskId": task_id}))["status"])


async def _until(check: Any, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def _mixed_load(s: Stack) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        async with _session(http, s, "acme", "alice") as alice, _session(http, s, "globex", "carol") as carol:
            # tasks that complete, fail (tool error), crash (JSON-RPC error), report progress; twice, with
            # scrapes between: a labelled series appears at its first event, so only the second one moves a rate
            for _round in range(2):
                for rpc, tool_name, args in [
                    (alice, "echo", {"text": "hi"}), (carol, "echo", {"text": "hi"}), (alice, "fail", {"message": "no"}),
                    (carol, "crash", {"message": "boom"}), (alice, "sleep", {"seconds": 0.2}),
                    (carol, "count", {"n": 3, "interval_ms": 20}), (alice, "up.echo", {"text": "hi"}),
                    (carol, "up.fail", {"message": "no"}),
                ]:  # fmt: skip
                    task_id = (await rpc.call_tool_as_task(tool_name, args))["task"]["taskId"]
                    await rpc.send("tasks/result", {"taskId": task_id})
                await alice.send("tasks/get", {"taskId": "no-such-task"})
                async with _session(http, s, "globex", "dave", version="2025-06-18") as older:  # plain calls
                    await older.send("tools/call", {"name": "echo", "arguments": {"text": "plain"}})
                modern = V2026Client(http, s.url, token=alice.token)  # the 2026-07-28 wire, sessionless
                await modern.post("server/discover")
                await modern.post("tools/call", {"name": "echo", "arguments": {"text": "modern"}})
                await modern.post("tasks/get", {"taskId": "no-such-task"})
                await asyncio.sleep(2.5)
            # a task cancelled while it runs, one left waiting for input, lookups that find nothing
            long_id = (await alice.call_tool_as_task("sleep", {"seconds": 60}))["task"]["taskId"]
            await alice.result("tasks/cancel", {"taskId": long_id})
            ask_id = (await carol.call_tool_as_task("confirm", {"prompt": "ship?"}))["task"]["taskId"]

            async def waiting() -> bool:
                return await _status(carol, ask_id) == "input_required"

            await _until(waiting, "input_required")
            for _ in range(3):
                await alice.send("tasks/get", {"taskId": "no-such-task"})
        # denied requests: no token, a forged token, a principal over its rate limit and its cap
        for headers in ({}, {"Authorization": "Bearer not-a-jwt"}):
            await http.post(s.url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=headers)
        async with _session(http, s, "acme", "burst") as burst:
            await asyncio.gather(*(burst.send("ping") for _ in range(110)))
        async with _session(http, s, "acme", "capped") as capped:
            held = [(await capped.call_tool_as_task("sleep", {"seconds": 30}))["task"]["taskId"] for _ in range(4)]
            await capped.send("tools/call", {"name": "sleep", "arguments": {"seconds": 1}, "task": {}})

            async def worker_holds_them() -> bool:  # (the confirm task, waiting for input, holds none)
                text = (await http.get(s.worker_metrics + "/metrics")).text
                line = next((x for x in text.splitlines() if x.startswith("mcp_tasks_runner_slots_in_use ")), "")
                return bool(line) and float(line.split()[1]) >= len(held)

            await _until(worker_holds_them, "the worker to run the sleeps")
            await asyncio.sleep(1.2)  # a scrape sees the busy slots
            # the worker dies holding tasks: the reaper requeues them (sleep is safe to re-run)
            s.stop("worker", signal.SIGKILL)
            s.start("worker", [MCP_TASKS, "worker"])

            async def reaped() -> bool:
                scraped = [
                    (await http.get(m + "/metrics")).text
                    for m in (s.serve_metrics, s.worker_metrics)
                    if await _up(http, m)
                ]
                return any("mcp_tasks_lease_losses_total{" in text for text in scraped)

            await _until(reaped, "the reaper to requeue the dead worker's tasks", timeout=30)
            _wait_http(s.worker_metrics + "/readyz", s.procs["worker"])
            for task_id in held:
                await capped.send("tasks/cancel", {"taskId": task_id})
        async with _session(http, s, "globex", "carol") as carol:
            await carol.send("tasks/cancel", {"taskId": ask_id})
        for m in (s.serve_metrics, s.worker_metrics):
            await http.get(m + "/readyz")


async def _up(http: httpx.AsyncClient, base: str) -> bool:
    try:
        return (await http.get(base + "/healthz", timeout=1)).status_code == 200
    except httpx.HTTPError:
        return False


def _query(s: Stack, expr: str) -> dict[str, Any]:
    r = httpx.get(s.prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    body: dict[str, Any] = r.json()
    return body


def _value(s: Stack, expr: str) -> float | None:
    result = _query(s, expr).get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None


def _poll(check: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _has_data(result: dict[str, Any]) -> bool:
    data = result.get("data", {})
    if data.get("resultType") == "scalar":
        return not math.isnan(float(data["result"][1]))
    return any(not math.isnan(float(series["value"][1])) for series in data.get("result", []))


def _substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


@pytest.mark.slow
def test_every_panel_returns_data_and_every_rule_evaluates_against_a_live_service(stack: Stack) -> None:
    started = time.monotonic()
    # Counters must be seen before and after the load, so rates and quantiles have something to say.
    _poll(lambda: _value(stack, 'count(up{job="mcp-tasks"} == 1)') == 2, "Prometheus scraping serve and worker")
    time.sleep(2)
    asyncio.run(asyncio.wait_for(_mixed_load(stack), timeout=DEADLINE_S - 40))
    _poll(lambda: _value(stack, 'count(up{job="mcp-tasks"} == 1)') == 2, "the restarted worker scraped")
    time.sleep(5)  # a few more scrapes and rule evaluations after the load

    report, problems = [], []
    for board, title, expr in panel_queries():
        result = _query(stack, _substitute(expr))
        if result.get("status") != "success":
            problems.append(f"panel {board} / {title}: does not evaluate: {result.get('error')}")
        elif title in NOT_FED:
            report.append(f"panel parsed (not fed yet: {NOT_FED[title]}): {board} / {title}")
        elif not _has_data(result):
            problems.append(f"panel {board} / {title}: no data for {expr}")
        else:
            report.append(f"panel ok ({len(result['data']['result'])} series): {board} / {title}")
    groups = yaml.safe_load(RULES.read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        name = rule.get("alert") or rule["record"]
        result = _query(stack, rule["expr"])
        if result.get("status") != "success":
            problems.append(f"rule {name}: does not evaluate: {result.get('error')}")
        else:
            state = "firing" if _has_data(result) else "quiet"
            report.append(f"{'alert' if 'alert' in rule else 'record'} evaluated ({state}): {name}")
    loaded = httpx.get(stack.prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    for group in loaded:
        for rule in group["rules"]:
            if rule["health"] == "err":
                problems.append(f"rule {rule['name']}: Prometheus reports {rule.get('lastError')}")
    assert sum(len(g["rules"]) for g in loaded) == sum(len(g["rules"]) for g in groups), "every rule loaded"
    for record in ("mcp_tasks:request_faults:ratio_rate5m",):
        assert _has_data(_query(stack, record)), f"{record} recorded nothing"

    print("\n".join(report))
    print(f"live check: {len(report)} evaluated in {time.monotonic() - started:.0f}s")
    assert problems == [], "\n".join(problems) + "\n" + stack.logs()
    assert time.monotonic() - started < DEADLINE_S
