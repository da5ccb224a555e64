"""Durable execution across processes: SIGKILL recovery and cross-process wake-ups (DESIGN.md §6)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx
import orjson
import pytest
from prometheus_client import REGISTRY as METRICS

from service.core import GC_THRESHOLDS
from tests.conftest import free_port, http_client, make_settings, serve
from tests.rpc import RpcSession

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def mcp_tasks(
    command: str, database_url: str, output: Path | None = None, **env: str
) -> AsyncIterator[tuple[subprocess.Popen[bytes], str]]:
    """Run ``python -m service COMMAND`` as its own process; yield it and its MCP URL. ``output``:
    a file for its stdout and stderr (else they are the test's)."""
    port = free_port()
    environ = {
        **os.environ,
        "MCP_TASKS_DATABASE_URL": database_url,
        "MCP_TASKS_PORT": str(port),
        "MCP_TASKS_TOOLS": "service.tools.demo,tests.toolpack",
        "MCP_TASKS_POLL_INTERVAL_MS": "100",
        "MCP_TASKS_SWEEP_INTERVAL_MS": "200",
        "MCP_TASKS_LEASE_MS": "60000",  # long: a test about lease expiry sets its own
        "MCP_TASKS_LOG_LEVEL": "WARNING",
        "MCP_TASKS_SHUTDOWN_GRACE_S": "0",  # tests that drain set it
        **env,
    }
    with contextlib.ExitStack() as files:
        out = files.enter_context(output.open("wb")) if output is not None else None
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", command], cwd=ROOT, env=environ, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        if command == "serve":
            async with http_client() as http, asyncio.timeout(30):
                while True:
                    assert proc.poll() is None, "server exited during start-up"
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(url.removesuffix("/mcp") + "/readyz")).status_code == 200:
                            break
                    await asyncio.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)


async def wait_for(predicate: object, timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        while not await predicate():  # type: ignore[operator]
            await asyncio.sleep(0.05)


async def test_sigkill_while_tasks_run_leaves_no_task_stuck_in_working(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """A killed process's tasks are taken over once their leases run out (issue 13, point 2: a lock
    that is gone no longer proves a runner dead), so its lease is short here."""
    db = await asyncpg.connect(database_url)
    try:
        async with mcp_tasks("serve", database_url, MCP_TASKS_LEASE_MS="3000") as (proc, url):
            s = RpcSession(http, url)
            await s.initialize()
            rerunnable = (await s.call_tool_as_task("sleep", {"seconds": 600}))["task"]["taskId"]
            not_rerunnable = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
            asking = (await s.call_tool_as_task("confirm", {}))["task"]["taskId"]

            async def all_claimed() -> bool:
                n = await db.fetchval("SELECT count(*) FROM tasks WHERE lease_owner IS NOT NULL")
                return bool(n == 3)

            await wait_for(all_claimed)
            old_owner = await db.fetchval("SELECT DISTINCT lease_owner FROM tasks")
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)

        async with mcp_tasks("serve", database_url) as (_proc, url):
            s = RpcSession(http, url)
            await s.initialize()

            async def recovered() -> bool:
                rows = await db.fetch("SELECT status, lease_owner FROM tasks")
                return all(r["lease_owner"] != old_owner for r in rows) and all(
                    r["status"] != "input_required" for r in rows
                )

            await wait_for(recovered)
            for task_id in (not_rerunnable, asking):
                task = await s.result("tasks/get", {"taskId": task_id})
                assert task["status"] == "failed"
                assert "stopped before the task finished" in task["statusMessage"]
                error = await s.error("tasks/result", {"taskId": task_id})
                assert error["code"] == -32603
            again = await s.result("tasks/get", {"taskId": rerunnable})
            assert again["status"] == "working"
            assert await db.fetchval("SELECT attempts FROM tasks WHERE task_id = $1", rerunnable) == 2
            assert (await s.result("tasks/cancel", {"taskId": rerunnable}))["status"] == "cancelled"
    finally:
        await db.close()


async def test_tasks_result_on_one_process_wakes_when_another_process_finishes_the_task(
    database_url: str, http: httpx.AsyncClient
) -> None:
    # The front end runs no tasks and polls only every 10 minutes: only NOTIFY can wake it in time.
    front = make_settings(database_url, runner_concurrency=0, poll_interval_ms=600_000)
    async with mcp_tasks("worker", database_url), serve(front) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("sleep", {"seconds": 0.5}))["task"]["taskId"]
        async with asyncio.timeout(15):
            result = await s.result("tasks/result", {"taskId": task_id})
        assert result["content"][0]["text"] == "slept 0.5s"


async def test_cancel_on_one_process_stops_the_tool_running_in_another(
    database_url: str, http: httpx.AsyncClient
) -> None:
    front = make_settings(database_url, runner_concurrency=0)
    db = await asyncpg.connect(database_url)
    try:
        async with mcp_tasks("worker", database_url), serve(front) as running:
            s = RpcSession(http, running.url)
            await s.initialize()
            task_id = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]

            async def claimed() -> bool:
                owner = await db.fetchval("SELECT lease_owner FROM tasks WHERE task_id = $1", task_id)
                return owner is not None

            await wait_for(claimed)
            assert (await s.result("tasks/cancel", {"taskId": task_id}))["status"] == "cancelled"
            row = await db.fetchrow("SELECT status, lease_owner, outcome FROM tasks WHERE task_id = $1", task_id)
            assert (row["status"], row["lease_owner"], row["outcome"]) == ("cancelled", None, None)
    finally:
        await db.close()


async def test_sigterm_lets_short_tasks_finish_and_hands_long_ones_back(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """A deploy (issue 13): on SIGTERM the runner claims nothing more; a task that ends within
    MCP_TASKS_SHUTDOWN_GRACE_S completes on the draining process, exactly once; what is still
    running then goes back: re-queued if its tool may re-run, else failed with a clear message."""
    async with mcp_tasks("serve", database_url, MCP_TASKS_SHUTDOWN_GRACE_S="3") as (proc, url):
        s = RpcSession(http, url)
        await s.initialize()
        short = (await s.call_tool_as_task("sleep", {"seconds": 1}))["task"]["taskId"]
        rerunnable = (await s.call_tool_as_task("sleep", {"seconds": 600}))["task"]["taskId"]
        not_rerunnable = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        db = await asyncpg.connect(database_url)
        try:

            async def all_claimed() -> bool:
                return bool(await db.fetchval("SELECT count(*) = 3 FROM tasks WHERE lease_owner IS NOT NULL"))

            await wait_for(all_claimed)
            proc.send_signal(signal.SIGTERM)
            # uvicorn re-raises the signal after its graceful shutdown, so the status is -SIGTERM.
            assert await asyncio.to_thread(proc.wait, 30) in (0, -signal.SIGTERM)
            rows = {
                r["task_id"]: r
                for r in await db.fetch("SELECT task_id, status, lease_owner, status_message, attempts FROM tasks")
            }
        finally:
            await db.close()
    assert rows[short]["status"] == "completed"
    assert rows[short]["attempts"] == 1  # it ran once, on the draining process
    assert rows[not_rerunnable]["status"] == "failed"
    assert "Start the task again" in rows[not_rerunnable]["status_message"]
    assert rows[rerunnable]["status"] == "working"
    assert rows[rerunnable]["lease_owner"] is None
    assert "re-queued" in rows[rerunnable]["status_message"]


async def test_a_draining_process_is_not_ready_and_claims_nothing(database_url: str, http: httpx.AsyncClient) -> None:
    """A draining process takes no task, straight to a slot or by a claim: the task it accepted
    waits for another replica, which takes it when it starts, long after the draining process
    was told of the task and would have claimed it (at once, its slots being free)."""
    async with serve(make_settings(database_url)) as running:
        core = running.app.state.core
        readyz = running.url.removesuffix("/mcp") + "/readyz"
        assert (await http.get(readyz)).status_code == 200
        core.begin_drain(30)
        not_ready = await http.get(readyz)
        assert (not_ready.status_code, not_ready.json()["status"]) == (503, "draining")
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]  # held by whoever runs it
        async with serve(make_settings(database_url)) as other:
            db = await asyncpg.connect(database_url)
            try:
                async with asyncio.timeout(10):
                    while (
                        owner := await db.fetchval("SELECT lease_owner FROM tasks WHERE task_id = $1", task_id)
                    ) is None:
                        await asyncio.sleep(0.02)
            finally:
                await db.close()
            assert owner == other.app.state.core.runner.owner
            assert owner != core.runner.owner
            await s.result("tasks/cancel", {"taskId": task_id})


async def test_readyz_answers_503_within_its_bound_when_the_database_does_not_answer(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """/readyz waits READY_TIMEOUT_S for the database, not the driver's 60 s command timeout: its
    query is held behind a lock here (lock waits of requests not bounded for this server)."""
    from service.app import READY_TIMEOUT_S

    async with serve(make_settings(database_url, db_lock_timeout_ms=60_000)) as running:
        readyz = running.url.removesuffix("/mcp") + "/readyz"
        assert (await http.get(readyz)).status_code == 200
        holder = await asyncpg.connect(database_url)
        try:
            tx = holder.transaction()
            await tx.start()
            await holder.execute("LOCK TABLE alembic_version IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            stuck = await http.get(readyz, timeout=30)
            waited = time.monotonic() - started
            assert stuck.status_code == 503
            assert stuck.json() == {
                "status": "database unreachable",
                "detail": f"no answer within {READY_TIMEOUT_S:g} s",
            }
            assert READY_TIMEOUT_S <= waited < READY_TIMEOUT_S + 3
            await tx.rollback()
        finally:
            await holder.close()
        assert (await http.get(readyz)).status_code == 200


async def test_call_command_runs_a_tool_as_a_task_and_prints_its_result(database_url: str) -> None:
    async with mcp_tasks("serve", database_url) as (_proc, url):

        def call(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "service", "call", *argv, "--url", url],
                cwd=ROOT, capture_output=True, text=True, timeout=60, input=stdin,
            )  # fmt: skip

        legacy = await asyncio.to_thread(
            call, "count", "--arg", "n=2", "--arg", "interval_ms=50", "--wire", "2025-11-25"
        )
        # 2026-07-28 (the default): long enough to become a task, followed through subscriptions/listen.
        modern = await asyncio.to_thread(call, "sleep", "--arg", "seconds=1.5")
        # A question asked inside the request (a multi-round-trip call), answered at the prompt.
        asked = await asyncio.to_thread(call, "confirm", "--arg", "prompt=Ship it?", stdin="y\n")
    assert legacy.returncode == 0, legacy.stderr
    assert '"text": "counted to 2"' in legacy.stdout
    # Progress is best effort (P-2): the last one may travel behind the outcome and be cut off by it
    # (the stream ends at the terminal state its poll saw first); some progress must show.
    assert re.search(r"progress [12]/2 counted [12] of 2", legacy.stderr), legacy.stderr
    assert modern.returncode == 0, modern.stderr
    assert '"text": "slept 1.5s"' in modern.stdout
    assert "status completed" in modern.stderr
    assert asked.returncode == 0, asked.stderr
    assert '"text": "answer: ok=True"' in asked.stdout


async def test_sigterm_stops_the_embedded_database_too() -> None:
    """uvicorn re-raises SIGTERM after its graceful shutdown, which skips atexit hooks: the service
    must stop its embedded PostgreSQL itself, or every restart by an orchestrator leaks one. Without
    XDG_RUNTIME_DIR (sudo, containers, CI) it starts without a library's warning either."""
    import psutil

    data_dir = Path(tempfile.mkdtemp(prefix="mcp-tasks-embedded-", dir="/var/tmp"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MCP_TASKS_DATABASE_URL", "XDG_RUNTIME_DIR")}
    env.update({"MCP_TASKS_DATA_DIR": str(data_dir), "MCP_TASKS_PORT": str(port), "MCP_TASKS_LOG_LEVEL": "WARNING"})
    stderr = data_dir / "stderr.log"
    with open(stderr, "wb") as err:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "service", "serve"], cwd=ROOT, env=env, stderr=err)

    def embedded_postgres() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["name", "cmdline"]):
            if p.info["name"] == "postgres" and str(data_dir) in " ".join(p.info["cmdline"] or []):
                found.append(p)
        return found

    try:
        async with http_client() as http, asyncio.timeout(60):
            while True:
                assert proc.poll() is None, "server exited during start-up"
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                        break
                await asyncio.sleep(0.2)
        assert embedded_postgres(), "the embedded server should be running"
        assert "Warning" not in stderr.read_text(), stderr.read_text()
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
        async with asyncio.timeout(15):
            while embedded_postgres():
                await asyncio.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in embedded_postgres():
            p.kill()
        shutil.rmtree(data_dir, ignore_errors=True)


async def test_a_task_whose_create_answer_was_lost_is_still_run_by_its_runner(database_url: str) -> None:
    """A create under a reserved slot can commit and then lose its answer (the request cancelled):
    the runner looks the task up and runs it rather than leaving it leased and idle."""
    async with serve(make_settings(database_url)) as running:
        runner = running.app.state.core.runner
        reservation = runner.reserve("local")
        assert reservation is not None
        lease = runner.lease()
        db = await asyncpg.connect(database_url)
        try:
            await db.execute(
                """INSERT INTO tasks (tenant_id, task_id, subject, wire, tool, arguments, ttl_ms,
                                      poll_interval_ms, expires_at, lease_owner, lease_expires_at,
                                      attempts, started_at)
                   VALUES ('local', 'orphan', 'local', '2025-11-25', 'echo', '{"text": "still here"}', 60000, 100,
                           now() + interval '1 minute', $1, now() + interval '30 seconds', 1, now())""",
                lease.owner,
            )
            runner.answer_lost(reservation, "orphan")
            async with asyncio.timeout(10):
                while await db.fetchval("SELECT status FROM tasks WHERE task_id = 'orphan'") != "completed":
                    await asyncio.sleep(0.1)
                # The create's slot is given back (a claim in flight reserves slots of its own meanwhile).
                while runner.ledger.held().get("local", 0):
                    await asyncio.sleep(0.01)
        finally:
            await db.close()


async def test_a_lost_create_answer_for_a_task_the_runner_already_runs_does_not_start_it_again(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """The look-up after a lost create answer finds the row leased to this runner; when the runner
    already runs that task (its create was adopted after all, or its claim took it), the look-up
    only gives the slot back: one run per task, never two under one key ("nothing runs twice")."""
    from tests.toolpack import signal as tool_signal

    key = f"adopt-twice-{os.getpid()}"
    async with serve(make_settings(database_url)) as running:
        runner = running.app.state.core.runner
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("hang", {"key": key}))["task"]["taskId"]
        async with asyncio.timeout(10):
            await tool_signal(key, "started").wait()
        first = runner.ledger.runs[("local", task_id)]
        reservation = runner.reserve("local")
        assert reservation is not None
        runner.answer_lost(reservation, task_id)
        async with asyncio.timeout(10):
            while runner.ledger.held().get("local", 0) > 1:  # the look-up ends by giving the slot back
                await asyncio.sleep(0.01)
        # The look-up's answer was decided without starting anything: the one run goes on.
        assert runner.ledger.runs[("local", task_id)] is first
        assert runner.busy == 1
        await s.result("tasks/cancel", {"taskId": task_id})


def test_mcp_tasks_serve_tunes_the_cyclic_collector_before_it_serves(database_url: str) -> None:
    """`mcp-tasks serve` (its real start-up: settings, app, schema check) tunes CPython's cyclic
    collector before uvicorn runs (service.core.tune_gc): start-up objects frozen out of the
    generations, and the young generation collected every 50,000 allocations, not 700. With
    6,400 extension tasks running, the default collections cost 143-150 µs per tasks/get in
    process, 18 µs so (measured in b80616e). uvicorn's run is replaced by a report of
    the collector's state at that moment."""
    probe = (
        "import gc, sys, uvicorn\n"
        "uvicorn.Server.run = lambda self, *a, **k: print('GC', gc.get_threshold(), gc.get_freeze_count())\n"
        "from service.cli import main\n"
        "main(['serve'])\n"
    )
    env = {**os.environ, "MCP_TASKS_DATABASE_URL": database_url, "MCP_TASKS_LOG_LEVEL": "WARNING"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    found = re.search(r"^GC \((\d+), (\d+), (\d+)\) (\d+)$", out.stdout, re.M)
    assert found, out.stdout + out.stderr
    assert tuple(int(g) for g in found.groups()[:3]) == GC_THRESHOLDS
    assert int(found.group(4)) > 10_000  # the modules and the app, frozen


async def test_a_runner_claims_only_tasks_whose_tool_it_has(database_url: str, http: httpx.AsyncClient) -> None:
    """Issue 13, point 3: a task accepted where its tool pack is loaded waits for a runner that has
    the pack, instead of being claimed and failed ("unknown tool") by one that does not."""
    front_settings = make_settings(database_url, runner_concurrency=0)  # accepts, runs nothing
    async with serve(front_settings) as front, mcp_tasks("worker", database_url, MCP_TASKS_TOOLS="service.tools.demo"):
        s = RpcSession(http, front.url)
        await s.initialize()
        only_in_tests_pack = (await s.call_tool_as_task("batch", {"items": 2}))["task"]["taskId"]
        in_both = (await s.call_tool_as_task("echo", {"text": "x"}))["task"]["taskId"]

        async def echo_done() -> bool:
            return (await s.result("tasks/get", {"taskId": in_both}))["status"] == "completed"

        await wait_for(echo_done)  # the demo-only worker runs what it can
        assert (await s.result("tasks/get", {"taskId": only_in_tests_pack}))["status"] == "working"
        async with mcp_tasks("worker", database_url):  # a worker with both packs

            async def batch_done() -> bool:
                return (await s.result("tasks/get", {"taskId": only_in_tests_pack}))["status"] == "completed"

            await wait_for(batch_done)


async def test_killed_database_connections_are_retry_shortly_and_lose_no_outcome(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 13, point 4: the service's backends killed again and again under light load: clients
    see only successes or -32001 (retry shortly), never -32603, and a task finishing meanwhile
    ends completed (its outcome write is retried), not 'could not be stored'."""
    async with serve(make_settings(database_url)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("sleep", {"seconds": 1.5}))["task"]["taskId"]
        admin = await asyncpg.connect(database_url)
        codes: list[int] = []
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + 3
            while loop.time() < end:
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND pid <> pg_backend_pid() AND application_name = 'mcp-tasks'"
                )
                for method, params in (("tasks/get", {"taskId": task_id}), ("tools/call", {"name": "echo", "arguments": {"text": "x"}})):  # fmt: skip
                    reply = await s.send(method, params)
                    if "error" in reply:
                        codes.append(reply["error"]["code"])
                await asyncio.sleep(0.05)
        finally:
            await admin.close()
        assert set(codes) <= {-32001}, codes

        async def completed() -> bool:
            reply = await s.send("tasks/get", {"taskId": task_id})
            return reply.get("result", {}).get("status") in ("completed", "failed")

        await wait_for(completed)
        final = await s.result("tasks/get", {"taskId": task_id})
        assert final["status"] == "completed", final


async def test_a_forged_cancel_event_does_not_stop_a_running_task(database_url: str, http: httpx.AsyncClient) -> None:
    """Security review, point 3: an event is a hint; the runner re-reads the row before it stops a
    task, and counts the hint its row did not confirm."""
    async with serve(make_settings(database_url)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        runner = running.app.state.core.runner

        async def running_here() -> bool:
            return ("local", task_id) in runner.ledger.runs

        async def stopped_here() -> bool:
            return not await running_here()

        await wait_for(running_here)
        before = METRICS.get_sample_value("mcp_tasks_runner_unconfirmed_stops_total") or 0.0
        admin = await asyncpg.connect(database_url)
        try:
            forged = orjson.dumps({"v": 1, "k": "cancel", "tenant_id": "local", "task_id": task_id}).decode()
            await admin.execute("SELECT pg_notify('mcp_tasks', $1)", forged)
            async with asyncio.timeout(10):  # the runner re-read the row, which says the task is still its own
                while (METRICS.get_sample_value("mcp_tasks_runner_unconfirmed_stops_total") or 0.0) == before:
                    await asyncio.sleep(0.01)
            assert ("local", task_id) in runner.ledger.runs
            assert (await s.result("tasks/get", {"taskId": task_id}))["status"] == "working"
            await s.result("tasks/cancel", {"taskId": task_id})  # a real cancel still stops it
            await wait_for(stopped_here)
        finally:
            await admin.close()


async def test_a_database_blip_while_a_claimed_task_reads_its_session_does_not_fail_it(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """A claimed task of a 2025-11-25 session reads what its client declared from the session row
    before its tool starts. That read failing once (the database away for a moment) is retried,
    as an outcome's write is: before, the task failed as "could not record its outcome"."""
    from service.domain.errors import Unavailable

    async with (
        serve(make_settings(database_url, runner_concurrency=0)) as front,
        serve(make_settings(database_url)) as worker,
    ):
        store = worker.app.state.core.runner.store
        real = store.session_capabilities
        failures = []

        async def once_unavailable(tenant_id: str, session_id: str) -> dict[str, object]:
            if not failures:
                failures.append(session_id)
                raise Unavailable("database unavailable: injected for the test")
            return await real(tenant_id, session_id)

        store.session_capabilities = once_unavailable
        s = RpcSession(http, front.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("echo", {"text": "x"}))["task"]["taskId"]

        async def ended() -> bool:
            return (await s.result("tasks/get", {"taskId": task_id}))["status"] != "working"

        await wait_for(ended)
        assert failures, "the claiming runner never read the session (the test did not reach the read)"
        assert (await s.result("tasks/get", {"taskId": task_id}))["status"] == "completed"


async def test_a_run_stopped_while_it_reads_its_session_goes_back_to_the_queue_whatever_its_tool(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """A claimed task of a 2025-11-25 session reads what its client declared before its tool is
    called. A runner shut down during that read never ran the tool, so the task goes back to the
    queue even when its tool may not run twice (`hang`). Before, it was handed back as if its tool
    had run, and such a task was failed as "the runner stopped"."""
    async with serve(make_settings(database_url, runner_concurrency=0)) as front:
        s = RpcSession(http, front.url)
        await s.initialize()
        async with serve(make_settings(database_url)) as worker:
            reading = asyncio.Event()

            async def never_answers(tenant_id: str, session_id: str) -> dict[str, object]:
                reading.set()
                await asyncio.Event().wait()
                raise AssertionError("unreachable")

            worker.app.state.core.runner.store.session_capabilities = never_answers
            task_id = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
            await asyncio.wait_for(reading.wait(), timeout=15)
        # The worker was shut down while the run waited for the read.
        task = await s.result("tasks/get", {"taskId": task_id})
        assert task["status"] == "working", task
        conn = await asyncpg.connect(database_url)
        try:
            row = await conn.fetchrow("SELECT lease_owner, outcome FROM tasks WHERE task_id = $1", task_id)
        finally:
            await conn.close()
        assert row is not None
        assert (row["lease_owner"], row["outcome"]) == (None, None)
        await s.result("tasks/cancel", {"taskId": task_id})


async def test_ctrl_c_stops_serve_cleanly_without_a_traceback(database_url: str, tmp_path: Path) -> None:
    """SIGINT (Ctrl-C under `make run`): the server drains and exits 0, as `worker` does. uvicorn
    re-raises the signal after its own clean shutdown, which printed a KeyboardInterrupt traceback
    under an orderly "Finished server process"."""
    log = tmp_path / "serve.log"
    async with mcp_tasks("serve", database_url, output=log, MCP_TASKS_LOG_LEVEL="INFO") as (proc, _):
        proc.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(proc.wait, 30)
    text = log.read_text()
    assert "Finished server process" in text
    assert "Traceback" not in text, text
    assert code == 0


async def test_sigterm_with_work_in_flight_logs_no_error_and_no_traceback(database_url: str, tmp_path: Path) -> None:
    """Issue 44 §2: a normal shutdown (SIGTERM, as Kubernetes sends) with a task running, a GET
    stream and a tasks/result request open logs no ERROR line and no traceback, and exits 0."""
    log = tmp_path / "serve.log"
    async with mcp_tasks("serve", database_url, output=log, MCP_TASKS_LOG_LEVEL="INFO",
                         MCP_TASKS_LOG_FORMAT="json") as (proc, url), http_client() as http:  # fmt: skip
        s = RpcSession(http, url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("sleep", {"seconds": 60}))["task"]["taskId"]
        opened = asyncio.Event()

        async def hold(method: str, params: dict[str, object] | None) -> None:
            with contextlib.suppress(httpx.HTTPError):
                if method == "GET":
                    async with http.stream("GET", url, headers=s.headers(Accept="text/event-stream")) as r:
                        opened.set()
                        async for _ in r.aiter_bytes():
                            pass
                else:
                    async with http.stream("POST", url, json=s.message(method, params), headers=s.headers()) as r:
                        async for _ in r.aiter_bytes():
                            pass

        held = [asyncio.create_task(hold("GET", None)), asyncio.create_task(hold("tasks/result", {"taskId": task_id}))]
        await asyncio.wait_for(opened.wait(), 10)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
        for job in held:
            job.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    text = log.read_text()
    assert code == 0, text
    assert "Traceback" not in text, text
    lines = [orjson.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert lines, text
    assert [e for e in lines if e["level"] in ("error", "critical")] == []
