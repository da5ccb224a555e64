"""The fault tests' parts (issue 13, point 7): real `mcp-tasks serve` replicas, a real haproxy and
redis-server, a retrying 2025-11-25 client that counts what it saw, and the figures line.

Everything listens on loopback ports chosen at random and runs for a bounded time; every process
started here is stopped by the context manager that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from service.client import sse_messages
from tests.conftest import http_client
from tests.faults.faultpack import events, executions, not_rerunnable

ROOT = Path(__file__).resolve().parents[2]
WIRE = "2025-11-25"
TERMINAL = frozenset({"completed", "failed", "cancelled"})
TOOLS = "service.tools.demo,tests.toolpack,tests.faults.faultpack"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require(tool: str) -> str:
    """The tool's path; a missing tool skips the test, except in CI (CI=true), where it fails."""
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not installed (`apt-get install {tool}`; .ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def figures(name: str, **counters: int) -> str:
    """Print and return the test's one figures line: ``FAULT <name>: failed_ops=N lost=N ...``."""
    line = f"FAULT {name}: " + " ".join(f"{k}={v}" for k, v in counters.items())
    print("\n" + line, flush=True)
    return line


def db_name(database_url: str) -> str:
    return database_url.rsplit("/", 1)[1].split("?", 1)[0]


# --- processes -------------------------------------------------------------------------------


@dataclass
class Replica:
    name: str
    port: int
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/mcp"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def start(self) -> None:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service", "serve"], cwd=ROOT, env=self.env, stdout=out, stderr=out
            )
        async with http_client(2) as http, asyncio.timeout(60):
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"replica {self.name} exited during start-up:\n{self.log()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(self.base + "/readyz")).status_code == 200:
                        return
                await asyncio.sleep(0.1)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return await asyncio.to_thread(self.proc.wait, timeout)

    async def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.kill()  # the tests judge SIGTERM themselves; at the end only speed counts
        await asyncio.to_thread(self.proc.wait)


def replica_env(database_url: str, port: int, **env: str) -> dict[str, str]:
    return {
        **os.environ,
        "MCP_TASKS_DATABASE_URL": database_url,
        "MCP_TASKS_HOST": "127.0.0.1",
        "MCP_TASKS_PORT": str(port),
        "MCP_TASKS_TOOLS": TOOLS,
        "MCP_TASKS_POLL_INTERVAL_MS": "100",
        "MCP_TASKS_SWEEP_INTERVAL_MS": "200",
        "MCP_TASKS_LEASE_MS": "3000",
        "MCP_TASKS_LOG_LEVEL": "INFO",
        "MCP_TASKS_SHUTDOWN_GRACE_S": "0",
        "MCP_TASKS_RUNNER_CONCURRENCY": "200",
        "MCP_TASKS_MAX_ACTIVE_TASKS_PER_REQUESTOR": "100000",
        "MCP_TASKS_MAX_ACTIVE_TASKS_PER_TENANT": "100000",
        "MCP_TASKS_RATE_LIMIT": "1000000/minute",
        "MCP_TASKS_RATE_LIMIT_UNAUTHENTICATED": "1000000/minute",
        "MCP_TASKS_RATE_LIMIT_NOT_FOUND": "1000000/minute",
        **env,
    }


@contextlib.asynccontextmanager
async def replicas(
    database_url: str, tmp: Path, names: tuple[str, ...], **env: str
) -> AsyncIterator[dict[str, Replica]]:
    """Start one `mcp-tasks serve` per name (in parallel), each on its own port, logging to tmp."""
    made = {}
    for name in names:
        port = free_port()
        made[name] = Replica(name, port, tmp / f"replica-{name}.log", replica_env(database_url, port, **env))
    try:
        await asyncio.gather(*(r.start() for r in made.values()))
        yield made
    finally:
        for r in made.values():
            await r.stop()


HAPROXY_CFG = """\
global
    maxconn 4096
defaults
    mode http
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    timeout http-request 10s
    # A replica that refuses the connection or drops it without an answer (it is stopping): the
    # request goes to the other one, as a production proxy would be configured.
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response
frontend mcp
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter 250ms fastinter 250ms downinter 250ms fall 1 rise 2
{servers}
"""


@dataclass
class Haproxy:
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"


@contextlib.asynccontextmanager
async def haproxy(tmp: Path, backends: list[Replica]) -> AsyncIterator[Haproxy]:
    """A real haproxy in front of the replicas: roundrobin, health checks on /readyz."""
    binary = require("haproxy")
    port = free_port()
    servers = "\n".join(f"    server {r.name} 127.0.0.1:{r.port} check" for r in backends)
    cfg = tmp / "haproxy.cfg"
    cfg.write_text(HAPROXY_CFG.format(port=port, servers=servers))
    log_path = tmp / "haproxy.log"
    check = subprocess.run([binary, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    with log_path.open("ab") as out:
        proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=out, stderr=out)
    proxy = Haproxy(port, proc, log_path)
    try:
        async with http_client(2) as http, asyncio.timeout(20):
            while True:
                assert proc.poll() is None, log_path.read_text()
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
        await asyncio.sleep(1)  # every backend's first checks are in (rise 2 x 250 ms)
        yield proxy
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)


@dataclass
class Redis:
    port: int
    binary: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        async with asyncio.timeout(10):
            while True:
                assert self.proc.poll() is None, "redis-server exited during start-up"
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", self.port)) == 0:
                        return
                await asyncio.sleep(0.05)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)


@contextlib.asynccontextmanager
async def redis_server() -> AsyncIterator[Redis]:
    """A redis-server of the test's own on a free port (the machine's shared one is never touched)."""
    redis = Redis(free_port(), require("redis-server"))
    await redis.start()
    try:
        yield redis
    finally:
        await redis.kill()


# --- the client ------------------------------------------------------------------------------


class OperationFailed(Exception):
    pass


@dataclass
class Tally:
    """What the clients saw: operations, retries by kind, and failures (retries exhausted, or an
    answer no retry can fix: a 500, a -32603, an unexpected error)."""

    ops: int = 0
    failed_ops: int = 0
    retries: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    phase: str = ""  # set by a test with phases (e.g. "outage"): answers and retries by phase
    answered: Counter[str] = field(default_factory=Counter)
    retries_in: Counter[tuple[str, str]] = field(default_factory=Counter)
    in_flight: Counter[str] = field(default_factory=Counter)  # url -> requests sent, not yet answered

    def fail(self, kind: str, detail: str) -> None:
        self.failed_ops += 1
        self.failures[kind] += 1
        if len(self.examples) < 5:
            self.examples.append(f"{kind}: {detail[:300]}")

    @property
    def retried(self) -> int:
        return self.retries.total()


RETRY_BUDGET_S = 40.0


class FaultClient:
    """A 2025-11-25 client that retries as the spec's guidance says: HTTP 503 (and a proxy's
    502/504), JSON-RPC -32001 and connection errors, with exponential backoff and jitter, for up
    to RETRY_BUDGET_S per operation. With several URLs it moves to the next one when a connection
    fails (no proxy in front)."""

    def __init__(self, http: httpx.AsyncClient, urls: list[str], tally: Tally, seed: int = 0) -> None:
        self.http = http
        self.urls = urls
        self.url_index = seed % len(urls)
        self.tally = tally
        self.session_id: str | None = None
        self.rng = random.Random(seed)
        self._ids = itertools.count(1)

    @property
    def url(self) -> str:
        return self.urls[self.url_index]

    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        if self.session_id:
            h["Mcp-Session-Id"] = self.session_id
            h["MCP-Protocol-Version"] = WIRE
        return h

    async def _post(self, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any] | None]:
        url = self.url
        self.tally.in_flight[url] += 1
        try:
            return await self._post_to(url, body)
        finally:
            self.tally.in_flight[url] -= 1

    async def _post_to(self, url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any] | None]:
        async with self.http.stream("POST", url, json=body, headers=self._headers()) as r:
            if r.status_code == 202:
                return 202, dict(r.headers), None
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                final: dict[str, Any] | None = None
                async for msg in sse_messages(r):
                    if "id" in msg and "method" not in msg:
                        final = msg
                return r.status_code, dict(r.headers), final
            raw = await r.aread()
            try:
                parsed = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                parsed = {"raw": raw[:200].decode(errors="replace")}
            return r.status_code, dict(r.headers), parsed

    async def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One client operation: its result, after as many retries as the budget allows."""
        result, _ = await self._call(method, params)
        return result

    async def _call(self, method: str, params: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, str]]:
        self.tally.ops += 1
        deadline = time.monotonic() + RETRY_BUDGET_S
        attempt = 0
        while True:
            body: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
            if not method.startswith("notifications/"):
                body["id"] = next(self._ids)
            if params is not None:
                body["params"] = params
            kind: str
            detail: str
            retry_after = 0.0
            try:
                status, headers, msg = await self._post(body)
            except httpx.TransportError as exc:
                kind, detail = f"conn:{type(exc).__name__}", str(exc)
                if len(self.urls) > 1:
                    self.url_index = (self.url_index + 1) % len(self.urls)
            else:
                if status == 202 and "id" not in body:
                    return {}, headers
                if status == 200 and msg is not None and "result" in msg:
                    self.tally.answered[self.tally.phase] += 1
                    result: dict[str, Any] = msg["result"]
                    return result, headers
                error = (msg or {}).get("error") or {}
                code = error.get("code")
                detail = f"HTTP {status} {orjson.dumps(msg).decode()[:300]}"
                if status in (502, 503, 504):
                    kind = f"http{status}"
                    with contextlib.suppress(ValueError):
                        retry_after = float(headers.get("retry-after", "0"))
                elif code == -32001:
                    kind = "rpc-32001"
                else:
                    kind = f"http{status}" if status != 200 else f"rpc{code}"
                    self.tally.fail(f"{method}:{kind}", detail)
                    raise OperationFailed(detail)
            if time.monotonic() >= deadline:
                self.tally.fail(f"{method}:{kind}:budget", detail)
                raise OperationFailed(f"retry budget spent: {detail}")
            self.tally.retries[kind] += 1
            self.tally.retries_in[(self.tally.phase, kind)] += 1
            attempt += 1
            backoff = min(1.0, 0.05 * 2**attempt) * (0.5 + self.rng.random())
            await asyncio.sleep(min(max(backoff, retry_after), 2.0))

    async def initialize(self) -> None:
        self.session_id = None
        params = {"protocolVersion": WIRE, "capabilities": {}, "clientInfo": {"name": "faults", "version": "1"}}
        result, headers = await self._call("initialize", params)
        assert result["protocolVersion"] == WIRE
        self.session_id = headers["mcp-session-id"]
        await self._call("notifications/initialized", None)

    async def create(self, tool: str, arguments: dict[str, Any]) -> str:
        """tools/call as a task; the task's id."""
        result = await self.request("tools/call", {"name": tool, "arguments": arguments, "task": {}})
        task_id: str = result["task"]["taskId"]
        return task_id

    async def get(self, task_id: str) -> dict[str, Any]:
        return await self.request("tasks/get", {"taskId": task_id})

    async def result(self, task_id: str) -> dict[str, Any]:
        return await self.request("tasks/result", {"taskId": task_id})

    async def follow(self, task_id: str, *, use_result: bool, timeout: float = 60) -> dict[str, Any]:
        """Poll tasks/get until the task is terminal (then tasks/result once if use_result)."""
        async with asyncio.timeout(timeout):
            while True:
                task = await self.get(task_id)
                if task["status"] in TERMINAL:
                    break
                await asyncio.sleep(0.1)
        if use_result and task["status"] == "completed":
            await self.result(task_id)
        return task


# --- judging ---------------------------------------------------------------------------------


async def task_rows(database_url: str) -> dict[str, asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return {
            r["task_id"]: r for r in await conn.fetch("SELECT task_id, status, status_message, attempts FROM tasks")
        }
    finally:
        await conn.close()


async def settle(database_url: str, task_ids: set[str], timeout: float) -> dict[str, asyncpg.Record]:
    """The tasks' rows once all are terminal, or as they are when ``timeout`` runs out."""
    deadline = time.monotonic() + timeout
    while True:
        rows = await task_rows(database_url)
        if all(t in rows and rows[t]["status"] in TERMINAL for t in task_ids) or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.2)


def judge(
    rows: dict[str, asyncpg.Record], known: dict[str, str], log_path: Path, *, killed: frozenset[int] = frozenset()
) -> tuple[int, int, list[str], dict[str, dict[str, list[int]]]]:
    """(lost, stuck, duplicated task ids, runs) for the tasks the clients were told about (id -> tool).
    Lost: no row. Stuck: not terminal. Duplicated: see ``duplicated``."""
    runs = executions(str(log_path))
    once = not_rerunnable(str(log_path))
    lost = sum(1 for t in known if t not in rows)
    stuck = sum(1 for t in known if t in rows and rows[t]["status"] not in TERMINAL)
    ordered = events(str(log_path))
    return lost, stuck, [t for t, seen in ordered.items() if duplicated(seen, once=t in once, killed=killed)], runs


def excused(log_path: Path, killed: frozenset[int]) -> dict[str, list[tuple[str, int]]]:
    """The tasks whose second run only the SIGKILL excuse allows (see ``duplicated``), with their
    runs in order: what a report of the excuse counts."""
    once = not_rerunnable(str(log_path))
    return {
        t: seen
        for t, seen in events(str(log_path)).items()
        if t not in once and duplicated(seen, once=False) and not duplicated(seen, once=False, killed=killed)
    }


def duplicated(seen: list[tuple[str, int]], *, once: bool, killed: frozenset[int] = frozenset()) -> bool:
    """Did one task run more often than its tool allows? ``seen``: its starts and ends in order, as
    (event, pid), in any task (also one whose create a client retried and never heard of).

    A non-rerunnable tool (``once``) may start only once. Any tool may run to its end only once,
    but for one excuse: a rerunnable tool's run that ended in a process SIGKILLed in the test
    (``killed``) may have lost its outcome with the process (killed between the tool's return and
    the commit of its finish), and running it again elsewhere is what the tool allows. So one such
    end does not count, and only if a start in another process came after it."""
    starts = [pid for event, pid in seen if event == "start"]
    if once and len(starts) > 1:
        return True
    ends = [i for i, (event, _pid) in enumerate(seen) if event == "end"]
    excuse = not once and any(
        seen[i][1] in killed and any(event == "start" and pid != seen[i][1] for event, pid in seen[i + 1 :])
        for i in ends
    )
    return len(ends) - excuse > 1


async def audit_verify(database_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MCP_TASKS_DATABASE_URL": database_url}
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "service", "audit", "verify"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
