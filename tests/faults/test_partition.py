"""A replica cut off its database (issue 13, point 2: fencing of runners), with real processes.

Two `mcp-tasks serve` replicas share one PostgreSQL: ``b`` directly, ``a`` (the one under test)
through a TCP proxy the test cuts. Tasks are created on ``a``, so they start there, leased to its
runner; a client polls them through ``b`` meanwhile. The tools record every execution (start, end,
cancelled, with the process id) in a file both replicas append to, so the test counts runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, http_client
from tests.faults.partitionpack import executions
from tests.faults.proxy import TcpProxy, tcp_proxy
from tests.rpc import RpcSession

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = frozenset({"completed", "failed", "cancelled"})
pytestmark = pytest.mark.slow


@dataclass
class Replica:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def base(self) -> str:
        return self.url.removesuffix("/mcp")

    def logged(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.asynccontextmanager
async def replica(name: str, database_url: str, tmp: Path, **env: str) -> AsyncIterator[Replica]:
    """``mcp-tasks serve`` in its own process, its log in a file; stopped on the way out."""
    port = free_port()
    log = tmp / f"{name}.log"
    environ = {
        **os.environ,
        "MCP_TASKS_DATABASE_URL": database_url,
        "MCP_TASKS_PORT": str(port),
        "MCP_TASKS_TOOLS": "service.tools.demo,tests.faults.partitionpack",
        "MCP_TASKS_POLL_INTERVAL_MS": "100",
        "MCP_TASKS_SWEEP_INTERVAL_MS": "200",
        "MCP_TASKS_LOG_LEVEL": "WARNING",
        "MCP_TASKS_SHUTDOWN_GRACE_S": "0",
        **env,
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"], cwd=ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT
        )
    running = Replica(name, proc, f"http://127.0.0.1:{port}/mcp", log)
    try:
        async with http_client() as http, asyncio.timeout(30):
            while True:
                assert proc.poll() is None, f"replica {name} exited during start-up:\n{running.logged()}"
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{running.base}/readyz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
        yield running
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)


def through(proxy: TcpProxy, database_url: str) -> str:
    parts = urlsplit(database_url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{proxy.port}"
    return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


@dataclass
class Poller:
    """A client of the healthy replica, following every task until it ends: its failures count."""

    session: RpcSession
    task_ids: list[str]
    statuses: dict[str, str] = field(default_factory=dict)
    failed_ops: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for task_id in self.task_ids:
                try:
                    reply = await self.session.send("tasks/get", {"taskId": task_id})
                except httpx.HTTPError:
                    self.failed_ops += 1
                    continue
                if "error" in reply:
                    self.failed_ops += 1
                else:
                    self.statuses[task_id] = reply["result"]["status"]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.2)

    def all_ended(self) -> bool:
        return all(self.statuses.get(t) in TERMINAL for t in self.task_ids)


async def wait_until(predicate: object, timeout: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not await predicate():  # type: ignore[operator]
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def metric(http: httpx.AsyncClient, replica: Replica, name: str, **labels: str) -> float:
    text = (await http.get(f"{replica.base}/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def figures(name: str, *, failed_ops: int, lost: int, stuck: int, duplicated: int) -> None:
    print(f"FAULT {name}: failed_ops={failed_ops} lost={lost} stuck={stuck} duplicated={duplicated}", flush=True)


def duplicated(runs: dict[str, list[tuple[str, int]]], once: set[str]) -> int:
    """Tasks with more than one completed run, or a must-not-re-run task started more than once."""
    return sum(
        1
        for task_id, events in runs.items()
        if [e for e, _pid in events].count("end") > 1 or (task_id in once and [e for e, _ in events].count("start") > 1)
    )


async def started(log: Path, task_ids: list[str]) -> bool:
    runs = executions(str(log))
    return all(any(e == "start" for e, _pid in runs.get(t, [])) for t in task_ids)


async def rows(database_url: str) -> dict[str, asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        found = await conn.fetch("SELECT task_id, status, status_message, attempts, lease_epoch FROM tasks")
    finally:
        await conn.close()
    return {r["task_id"]: r for r in found}


async def owners(database_url: str) -> dict[str, str | None]:
    conn = await asyncpg.connect(database_url)
    try:
        return {r["task_id"]: r["lease_owner"] for r in await conn.fetch("SELECT task_id, lease_owner FROM tasks")}
    finally:
        await conn.close()


async def test_a_cut_shorter_than_the_lease_changes_nothing(database_url: str, tmp_path: Path) -> None:
    """Issue 13, point 2: a database blip shorter than the lease (1.5 s of a 5 s lease) neither
    fails nor duplicates anything: every task finishes exactly once, on the runner that had it."""
    journal = tmp_path / "runs.log"
    env = {"FAULTS_PARTITION_LOG": str(journal), "MCP_TASKS_LEASE_MS": "5000"}
    async with (
        tcp_proxy(upstream_port=urlsplit(database_url).port or 5432) as proxy,
        replica("b", database_url, tmp_path, **env) as b,
        replica("a", through(proxy, database_url), tmp_path, **env) as a,
        http_client() as http,
    ):
        on_a, on_b = RpcSession(http, a.url), RpcSession(http, b.url)
        await on_a.initialize()
        await on_b.initialize()
        once = [
            (await on_a.call_tool_as_task("partition_work_once", {"seconds": 4}))["task"]["taskId"] for _ in range(2)
        ]
        again = [(await on_a.call_tool_as_task("partition_work", {"seconds": 4}))["task"]["taskId"] for _ in range(2)]
        task_ids = once + again
        await wait_until(lambda: started(journal, task_ids), 10, "the tools to start on a")
        assert {owner.split(":")[1] for owner in (await owners(database_url)).values() if owner} == {str(a.proc.pid)}

        poller = Poller(on_b, task_ids)
        stop = asyncio.Event()
        polling = asyncio.create_task(poller.run(stop))
        proxy.cut()
        await asyncio.sleep(1.5)
        proxy.heal()

        async def ended() -> bool:
            return poller.all_ended()

        try:
            await wait_until(ended, 30, "every task to end")
        finally:
            stop.set()
            await polling
        fenced_writes = await metric(http, a, "mcp_tasks_fenced_writes_total")
        fenced_tools = await metric(http, a, "mcp_tasks_runner_fenced_tasks_total")
    runs = executions(str(journal))
    stored = await rows(database_url)
    figures(
        "partition-short",
        failed_ops=poller.failed_ops,
        lost=sum(1 for t in task_ids if t not in stored),
        stuck=sum(1 for t in task_ids if t in stored and stored[t]["status"] not in TERMINAL),
        duplicated=duplicated(runs, set(once)),
    )
    assert poller.failed_ops == 0
    for task_id in task_ids:
        assert stored[task_id]["status"] == "completed", stored[task_id]
        assert (stored[task_id]["attempts"], stored[task_id]["lease_epoch"]) == (1, 0)  # never changed hands
        assert runs[task_id] == [("start", a.proc.pid), ("end", a.proc.pid)]
    assert (fenced_writes, fenced_tools) == (0, 0)


async def test_a_cut_longer_than_the_lease_fences_the_runner_and_runs_nothing_twice(
    database_url: str, tmp_path: Path
) -> None:
    """Issue 13, point 2: cut off for twice its 3 s lease, the runner stops its tools before the
    lease runs out; the other replica re-runs the rerunnable task once (one completed run in all)
    and fails the others with a clear message, never running them twice; the outcome the cut-off
    runner had in hand is refused by the fencing check when its database comes back."""
    journal = tmp_path / "runs.log"
    env = {"FAULTS_PARTITION_LOG": str(journal), "MCP_TASKS_LEASE_MS": "3000"}
    async with (
        tcp_proxy(upstream_port=urlsplit(database_url).port or 5432) as proxy,
        replica("b", database_url, tmp_path, **env) as b,
        replica("a", through(proxy, database_url), tmp_path, **env) as a,
        http_client() as http,
    ):
        on_a, on_b = RpcSession(http, a.url), RpcSession(http, b.url)
        await on_a.initialize()
        await on_b.initialize()
        rerunnable = (await on_a.call_tool_as_task("partition_work", {"seconds": 6}))["task"]["taskId"]
        once = (await on_a.call_tool_as_task("partition_work_once", {"seconds": 60}))["task"]["taskId"]
        # Ends during the cut: the runner holds its outcome and keeps trying to write it.
        in_hand = (await on_a.call_tool_as_task("partition_work_once", {"seconds": 1}))["task"]["taskId"]
        task_ids = [rerunnable, once, in_hand]
        await wait_until(lambda: started(journal, task_ids), 10, "the tools to start on a")
        assert {owner.split(":")[1] for owner in (await owners(database_url)).values() if owner} == {str(a.proc.pid)}

        poller = Poller(on_b, task_ids)
        stop = asyncio.Event()
        polling = asyncio.create_task(poller.run(stop))
        proxy.cut()
        cut_at = time.monotonic()

        async def fenced_on_a() -> bool:
            runs = executions(str(journal))
            return all(("cancelled", a.proc.pid) in runs.get(t, []) for t in (rerunnable, once))

        await wait_until(fenced_on_a, 10, "a to stop its tools")
        fenced_after = time.monotonic() - cut_at

        async def taken_over() -> bool:
            return poller.statuses.get(once) == "failed" and poller.statuses.get(in_hand) == "failed"

        await wait_until(taken_over, 10, "b to take the tasks over")
        await asyncio.sleep(max(0.0, 6.0 - (time.monotonic() - cut_at)))  # a cut of twice the lease
        proxy.heal()

        async def late_write_refused() -> bool:
            return await metric(http, a, "mcp_tasks_fenced_writes_total", op="finish") >= 1

        async def ended() -> bool:
            return poller.all_ended()

        try:
            await wait_until(late_write_refused, 20, "a's late outcome to be refused")
            await wait_until(ended, 30, "every task to end")
        finally:
            stop.set()
            await polling
        refused_finishes = await metric(http, a, "mcp_tasks_fenced_writes_total", op="finish")
        fenced_tools = await metric(http, a, "mcp_tasks_runner_fenced_tasks_total")
        assert (await http.get(f"{a.base}/readyz")).status_code == 200  # a recovered by itself
        a_log = a.logged()
    runs = executions(str(journal))
    stored = await rows(database_url)
    figures(
        "partition-long",
        failed_ops=poller.failed_ops,
        lost=sum(1 for t in task_ids if t not in stored),
        stuck=sum(1 for t in task_ids if t in stored and stored[t]["status"] not in TERMINAL),
        duplicated=duplicated(runs, {once, in_hand}),
    )
    assert poller.failed_ops == 0
    assert fenced_after < 3.0, "a must stop its tools before its lease can run out"
    # The rerunnable task: a's run was stopped, b's is the one completed run, and it wrote the outcome.
    assert runs[rerunnable] == [("start", a.proc.pid), ("cancelled", a.proc.pid), ("start", b.proc.pid),
                                ("end", b.proc.pid)]  # fmt: skip
    assert (stored[rerunnable]["status"], stored[rerunnable]["attempts"]) == ("completed", 2)
    # The others may not run again: failed, saying why, run once.
    assert runs[once] == [("start", a.proc.pid), ("cancelled", a.proc.pid)]
    assert runs[in_hand] == [("start", a.proc.pid), ("end", a.proc.pid)]
    for task_id in (once, in_hand):
        assert stored[task_id]["status"] == "failed"
        assert "stopped before the task finished" in stored[task_id]["status_message"]
    # a's outcome of in_hand came too late: refused by the fencing check, counted and logged.
    assert refused_finishes == 1
    assert fenced_tools == 2
    assert "refused: the task was taken over" in a_log
    assert "could not renew the leases of" in a_log
