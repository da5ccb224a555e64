"""Fencing of runners (issue 13, point 2): every write of a run carries its fencing token (lease
owner and epoch), and the reaper takes a lease only once its time has run out.

These are the statements as the runner and the reaper call them, on a real database; the fault
suite (tests/faults/test_partition.py) cuts a real process off its database."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY as METRICS

from service.domain.inputs import InputKind, PendingInput
from service.domain.principal import Caller, Principal
from service.domain.task import Outcome, OutcomeKind, Task
from service.runtime.handback import hand_back
from service.runtime.maintenance import Maintenance
from service.store import requests as rq
from service.store.db import APP_ROLE, RUNNER_ROLE, Database
from service.store.repository import RunnerStore, TaskStore
from service.tools.registry import Registry
from tests.conftest import make_settings, serve
from tests.faults.proxy import tcp_proxy
from tests.rpc import RpcSession
from tests.test_audit import audit_rows
from tests.toolpack import signal

OWNER = "runner-1"
RESULT = Outcome(OutcomeKind.RESULT, {"content": [{"type": "text", "text": "late"}], "isError": False})
REGISTRY = Registry.load(["service.tools.demo"])  # echo may re-run, crash may not


@pytest.fixture
async def stores(database_url: str) -> AsyncIterator[tuple[TaskStore, RunnerStore]]:
    app_db = Database(database_url, pool_size=2, role=APP_ROLE)
    runner_db = Database(database_url, pool_size=2, role=RUNNER_ROLE)
    await app_db.open()
    await runner_db.open()
    try:
        yield TaskStore(app_db), RunnerStore(runner_db)
    finally:
        await runner_db.close()
        await app_db.close()


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def queued(tasks: TaskStore, tool: str = "echo") -> str:
    owner = Principal(tenant_id="acme", subject="alice", client_id="c", issuer="https://issuer.test")
    request = rq.create(
        Caller(owner, "r", "127.0.0.1"), secrets.token_urlsafe(16), tool=tool, arguments={"text": "x"},
        surface="2025-11-25", session_id=None, client_capabilities={}, progress_token=None, ttl_ms=60_000,
        poll_interval_ms=100, max_per_requestor=100, max_per_tenant=1_000, lease=None, rerunnable=True,
        tool_version=None,
    )  # fmt: skip
    (task,) = await tasks.run([request])
    assert task is not None
    return task.task_id


async def claim_one(runner: RunnerStore, tool: str = "echo") -> Task:
    (task,) = await runner.claim(OWNER, 1, 60_000, 1, {tool: None}, tenant_share=32, held={})
    return task


def release(task: Task, *, only_if_lapsed: bool = False, never_started: bool = False) -> rq.ReleaseRequest:
    return hand_back(REGISTRY, tenant_id=task.tenant_id, task_id=task.task_id, subject=task.subject,
                     tool=task.tool, owner=OWNER, epoch=task.lease_epoch, why="re-running: test",
                     rerunnable=None, only_if_lapsed=only_if_lapsed, never_started=never_started)  # fmt: skip


async def taken_over_by_the_same_runner(runner: RunnerStore, first: Task) -> Task:
    """The run ``first`` lost its task (handed back, re-queued) and this runner claimed it again."""
    assert (await runner.release([release(first, never_started=True)]))[0] is not None
    second = await claim_one(runner, first.tool)
    assert (second.task_id, second.attempts) == (first.task_id, 2)
    return second


async def row(db: asyncpg.Connection, task_id: str) -> asyncpg.Record:
    found = await db.fetchrow(
        "SELECT status, outcome, lease_owner, lease_epoch, lease_expires_at, attempts FROM tasks WHERE task_id = $1",
        task_id,
    )
    assert found is not None
    return found


async def test_every_change_of_hands_gives_the_lease_a_new_epoch(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection
) -> None:
    """Issue 13, point 2: the epoch grows on a claim and on a hand-back, so no two runs share a token."""
    tasks, runner = stores
    task_id = await queued(tasks)
    assert (await row(db, task_id))["lease_epoch"] == 0
    first = await claim_one(runner)
    assert first.lease_epoch == 1
    second = await taken_over_by_the_same_runner(runner, first)
    assert second.lease_epoch == 3  # the hand-back made it 2, the claim 3
    assert (await row(db, task_id))["lease_epoch"] == 3


async def test_a_finish_with_a_stale_epoch_writes_nothing(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection, database_url: str
) -> None:
    """Issue 13, point 2: the first run's late outcome, from the very runner that holds the task
    again (same owner name), changes neither the row nor the audit trail; the current run's lands."""
    tasks, runner = stores
    task_id = await queued(tasks)
    first = await claim_one(runner)
    second = await taken_over_by_the_same_runner(runner, first)
    before = await row(db, task_id)

    late = rq.FinishRequest.of(first.tenant_id, task_id, first.subject, OWNER, RESULT, epoch=first.lease_epoch)
    assert await runner.finish([late]) == [None]
    assert await row(db, task_id) == before
    assert (before["status"], before["outcome"], before["lease_owner"]) == ("working", None, OWNER)
    assert not [e for e in await audit_rows(database_url, "acme") if e["action"] == "complete"]

    current = rq.FinishRequest.of(second.tenant_id, task_id, second.subject, OWNER, RESULT, epoch=second.lease_epoch)
    (done,) = await runner.finish([current])
    assert done is not None
    assert done.status.value == "completed"


async def test_a_release_with_a_stale_epoch_writes_nothing(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection, database_url: str
) -> None:
    """Issue 13, point 2: a hand-back by a run whose task was taken over neither re-queues nor fails it."""
    tasks, runner = stores
    rerunnable = await queued(tasks, "echo")
    first = await claim_one(runner, "echo")
    await taken_over_by_the_same_runner(runner, first)
    not_rerunnable = await queued(tasks, "crash")
    old = await claim_one(runner, "crash")
    await taken_over_by_the_same_runner(runner, old)
    before = {task_id: await row(db, task_id) for task_id in (rerunnable, not_rerunnable)}
    requeues = len([e for e in await audit_rows(database_url, "acme") if e["action"] == "requeue"])

    assert await runner.release(sorted([release(first), release(old)], key=lambda r: r.order)) == [None, None]
    assert {task_id: await row(db, task_id) for task_id in before} == before
    events = await audit_rows(database_url, "acme")
    assert len([e for e in events if e["action"] == "requeue"]) == requeues
    assert not [e for e in events if e["action"] == "complete"]


async def test_a_renewal_with_a_stale_epoch_extends_nothing(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection
) -> None:
    tasks, runner = stores
    task_id = await queued(tasks)
    first = await claim_one(runner)
    second = await taken_over_by_the_same_runner(runner, first)
    await db.execute("UPDATE tasks SET lease_expires_at = now() + interval '5 seconds' WHERE task_id = $1", task_id)
    before = (await row(db, task_id))["lease_expires_at"]
    key = (first.tenant_id, task_id)
    assert await runner.renew(OWNER, 60_000, [(key, first.lease_epoch)]) == set()
    assert (await row(db, task_id))["lease_expires_at"] == before
    assert await runner.renew(OWNER, 60_000, [(key, second.lease_epoch)]) == {key}
    assert (await row(db, task_id))["lease_expires_at"] > before


async def test_a_question_from_a_stale_run_is_not_asked(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection
) -> None:
    """A run whose task was taken over cannot put it in input_required (nor store its question)."""
    tasks, runner = stores
    task_id = await queued(tasks)
    first = await claim_one(runner)
    second = await taken_over_by_the_same_runner(runner, first)
    question = PendingInput(secrets.token_hex(8), InputKind.ELICITATION, {"message": "go on?"})
    assert await runner.ask(first, OWNER, question) is False
    assert (await row(db, task_id))["status"] == "working"
    assert await db.fetchval("SELECT count(*) FROM task_messages WHERE task_id = $1", task_id) == 0
    assert await runner.ask(second, OWNER, question) is True


async def test_the_reaper_leaves_a_lease_whose_lock_is_gone_until_its_time_runs_out(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection, database_url: str
) -> None:
    """Issue 13, point 2: a runner cut off from the database loses its liveness lock but still
    runs; its tasks are taken only once their leases have run out (they were taken within a second)."""
    tasks, runner = stores
    task_id = await queued(tasks)
    await claim_one(runner)  # lease_key 1: an advisory lock nobody holds
    runner_db = Database(database_url, pool_size=1, role=RUNNER_ROLE)
    await runner_db.open()
    reaper = Maintenance(runner_db, REGISTRY, interval_s=60, session_idle_ms=60_000)
    try:
        assert await reaper.reap_lost_leases() == 0
        assert (await row(db, task_id))["lease_owner"] == OWNER
        await db.execute("UPDATE tasks SET lease_expires_at = now() - interval '1 second' WHERE task_id = $1", task_id)
        assert await reaper.reap_lost_leases() == 1
    finally:
        await runner_db.close()
    after = await row(db, task_id)
    assert (after["status"], after["lease_owner"], after["lease_epoch"]) == ("working", None, 2)


async def test_the_reapers_release_rechecks_under_the_row_lock_that_the_lease_ran_out(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection
) -> None:
    """A lease found lapsed but renewed before the reaper's release (the runner came back) stays."""
    tasks, runner = stores
    task_id = await queued(tasks)
    task = await claim_one(runner)
    await db.execute("UPDATE tasks SET lease_expires_at = now() - interval '1 second' WHERE task_id = $1", task_id)
    (lost,) = await runner.lost_leases(10)
    assert (lost.task_id, lost.epoch) == (task_id, task.lease_epoch)
    assert await runner.renew(OWNER, 60_000, [((task.tenant_id, task_id), task.lease_epoch)])
    assert await runner.release([release(task, only_if_lapsed=True)]) == [None]
    after = await row(db, task_id)
    assert (after["status"], after["lease_owner"], after["lease_epoch"]) == ("working", OWNER, task.lease_epoch)


def fenced_tasks() -> float:
    return METRICS.get_sample_value("mcp_tasks_runner_fenced_tasks_total") or 0.0


async def test_a_runner_cut_off_its_database_stops_its_tool_before_its_lease_runs_out(
    database_url: str, db: asyncpg.Connection, http: httpx.AsyncClient
) -> None:
    """Issue 13, point 2 (self-fencing), in one process: with every connection of the service cut
    (a proxy that blackholes them), the runner cancels the tool of a task whose lease it cannot
    renew before that lease can run out, and gives the task back once the database answers."""
    key = secrets.token_hex(4)
    parts = urlsplit(database_url)
    async with tcp_proxy(upstream_port=parts.port or 5432) as proxy:
        user = parts.netloc.rsplit("@", 1)[0]
        through = parts._replace(netloc=f"{user}@127.0.0.1:{proxy.port}").geturl()
        async with serve(make_settings(through, lease_ms=2_000)) as running:
            s = RpcSession(http, running.url)
            await s.initialize()
            task_id = (await s.call_tool_as_task("hang", {"key": key}))["task"]["taskId"]
            async with asyncio.timeout(10):
                await signal(key, "started").wait()
            before = fenced_tasks()
            proxy.cut()
            cut_at = time.monotonic()
            async with asyncio.timeout(10):
                await signal(key, "cancelled").wait()
            stopped_after = time.monotonic() - cut_at
            assert stopped_after < 2.0, "the tool must stop before the lease can run out"
            assert fenced_tasks() == before + 1
            proxy.heal()
            async with asyncio.timeout(10):  # handed back under its epoch: hang may not re-run
                while (await row(db, task_id))["status"] != "failed":
                    await asyncio.sleep(0.05)
    after = await row(db, task_id)
    assert (after["lease_owner"], after["lease_epoch"], after["attempts"]) == (None, 1, 1)
