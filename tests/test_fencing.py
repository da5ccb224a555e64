"""Fencing of runners (issue 13, point 2): every write of a run carries its fencing token (lease
owner and epoch), and the reaper takes a lease only once its time has run out.

These are the statements as the runner and the reaper call them, on a real database; the fault
suite (tests/faults/test_partition.py) cuts a real process off its database."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY as METRICS

from service.domain.errors import Unavailable
from service.domain.inputs import InputKind, PendingInput
from service.domain.principal import Caller, Principal
from service.domain.task import Outcome, OutcomeKind, Task
from service.runtime.handback import hand_back
from service.runtime.maintenance import Maintenance
from service.store import requests as rq
from service.store.db import APP_ROLE, RUNNER_ROLE, Database
from service.store.runners import RunnerStore
from service.store.tasks import TaskStore
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
    runner = RunnerStore(runner_db)
    await runner.publish(OWNER, {}, 60_000)  # the runner's row: the lease on all its tasks
    try:
        yield TaskStore(app_db), runner
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
        wire="2025-11-25", session_id=None, client_capabilities={}, progress_token=None, ttl_ms=60_000,
        poll_interval_ms=100, max_per_requestor=100, max_per_tenant=1_000, lease=None, rerunnable=True,
        tool_version=None,
    )  # fmt: skip
    (task,) = await tasks.create([request])
    assert task is not None
    return task.task_id


async def claim_one(runner: RunnerStore, tool: str = "echo") -> Task:
    (task,) = await runner.claim(OWNER, 240_000, 1, {tool: None}, tenant_share=32, held={})
    return task


def release(task: Task, *, only_if_lapsed: bool = False, never_started: bool = False) -> rq.HandBackRequest:
    return hand_back(tenant_id=task.tenant_id, task_id=task.task_id, subject=task.subject, tool=task.tool,
                     owner=OWNER, epoch=task.lease_epoch, why="re-running: test", rerunnable=task.rerunnable is True,
                     only_if_lapsed=only_if_lapsed, never_started=never_started)  # fmt: skip


async def taken_over_by_the_same_runner(runner: RunnerStore, first: Task) -> Task:
    """The run ``first`` lost its task (handed back, re-queued) and this runner claimed it again."""
    assert (await runner.hand_back([release(first, never_started=True)]))[0] is not None
    second = await claim_one(runner, first.tool)
    assert (second.task_id, second.attempts) == (first.task_id, 2)
    return second


async def beats(db: asyncpg.Connection, n: int, task_id: str) -> list[asyncpg.Record]:
    """Until the runner has beaten ``n`` times (its row's live_until moved on; 10 s at most): its
    row and ``task_id``'s own lease as each beat left them, the one before them first."""
    sql = "SELECT r.live_until, t.lease_expires_at FROM runners r, tasks t WHERE t.task_id = $1"
    seen = [await db.fetchrow(sql, task_id)]
    async with asyncio.timeout(10):
        while len(seen) <= n:
            now = await db.fetchrow(sql, task_id)
            if now["live_until"] != seen[-1]["live_until"]:
                seen.append(now)
            await asyncio.sleep(0.02)
    return seen


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

    assert await runner.hand_back(sorted([release(first), release(old)], key=lambda r: r.order)) == [None, None]
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
    assert await runner.renew(OWNER, 60_000, [(key, first.lease_epoch)], 240_000) == (True, set(), set())
    assert (await row(db, task_id))["lease_expires_at"] == before
    assert await runner.renew(OWNER, 60_000, [(key, second.lease_epoch)], 240_000) == (True, {key}, set())
    assert (await row(db, task_id))["lease_expires_at"] > before


async def test_a_renewal_skips_a_row_locked_elsewhere_and_says_it_is_still_ours(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection, database_url: str
) -> None:
    """A transaction left open on one task row (an operator's psql, a stuck write) must not hold up
    the heartbeat: before, the beat waited on that row until its lock timeout, failed, and after
    three quarters of a lease every run of the runner was fenced. The beat now extends the runner's
    row and the other tasks at once, and reports the locked one as still ours but not renewed."""
    tasks, runner = stores
    locked_id, free_id = await queued(tasks), await queued(tasks)
    locked, free = await claim_one(runner), await claim_one(runner)
    by_id = {locked.task_id: locked, free.task_id: free}
    locked, free = by_id[locked_id], by_id[free_id]
    due = [((t.tenant_id, t.task_id), t.lease_epoch) for t in (locked, free)]
    before = (await row(db, locked_id))["lease_expires_at"]
    holder = await asyncpg.connect(database_url)
    try:
        await holder.execute("BEGIN")
        await holder.execute("SELECT 1 FROM tasks WHERE task_id = $1 FOR UPDATE", locked_id)
        async with asyncio.timeout(5):  # no lock wait (the runner's lock timeout is a second)
            renewed = await runner.renew(OWNER, 60_000, due, 240_000)
        assert renewed == (True, {(free.tenant_id, free_id)}, {(locked.tenant_id, locked_id)})
    finally:
        await holder.close()  # its transaction ends: the row is free again
    assert (await row(db, locked_id))["lease_expires_at"] == before
    assert await runner.renew(OWNER, 60_000, due, 240_000) == (True, {k for k, _ in due}, set())
    assert (await row(db, locked_id))["lease_expires_at"] > before


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


async def test_the_reaper_leaves_a_lease_alone_until_its_time_runs_out(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection, database_url: str
) -> None:
    """Issue 13, point 2: a runner cut off from the database still runs; its tasks are taken only
    once their leases have run out (they were taken within a second when a lost connection counted)."""
    tasks, runner = stores
    task_id = await queued(tasks)
    await claim_one(runner)
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
    assert await runner.renew(OWNER, 60_000, [((task.tenant_id, task_id), task.lease_epoch)], 240_000) == (
        True, {(task.tenant_id, task_id)}, set(),
    )  # fmt: skip
    assert await runner.hand_back([release(task, only_if_lapsed=True)]) == [None]
    after = await row(db, task_id)
    assert (after["status"], after["lease_owner"], after["lease_epoch"]) == ("working", OWNER, task.lease_epoch)


async def lapse_row(db: asyncpg.Connection, owner: str = OWNER) -> None:
    await db.execute("UPDATE runners SET live_until = now() - interval '1 second' WHERE owner = $1", owner)


async def test_a_lease_lapses_with_its_runners_row_whatever_the_tasks_own_lease_says(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection
) -> None:
    """docs/decisions.md, "Fencing": a lease holds while the task's own lease and its owner's row
    both hold. A runner that stopped beating (dead, cut off) loses every task with its row, though
    their own leases run for minutes; the release re-checks that under the row lock."""
    tasks, runner = stores
    task_id = await queued(tasks)
    task = await claim_one(runner)
    assert await runner.lost_leases(10) == []
    await lapse_row(db)
    (lost,) = await runner.lost_leases(10)
    assert (lost.task_id, lost.epoch) == (task_id, task.lease_epoch)
    assert await db.fetchval("SELECT lease_expires_at > now() + interval '1 minute' FROM tasks WHERE task_id = $1",
                             task_id)  # fmt: skip
    (moved,) = await runner.hand_back([release(task, only_if_lapsed=True)])
    assert moved is not None
    assert ((await row(db, task_id))["lease_owner"], moved.status.value) == (None, "working")  # re-queued


async def test_a_beat_extends_the_runners_row_and_only_the_due_task_leases(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection
) -> None:
    """A heartbeat writes one row for all of a runner's tasks, and a task's own lease only when the
    runner says it is due (issue 15: 6,400 running tasks cost 0.7 s of PostgreSQL per beat when
    every beat rewrote every one of them)."""
    tasks, runner = stores
    due_id, other_id = await queued(tasks), await queued(tasks)
    first, second = await claim_one(runner), await claim_one(runner)
    due = first if first.task_id == due_id else second
    leases = {t: (await row(db, t))["lease_expires_at"] for t in (due_id, other_id)}
    live_until = await db.fetchval("SELECT live_until FROM runners WHERE owner = $1", OWNER)
    key = (due.tenant_id, due.task_id)
    assert await runner.renew(OWNER, 120_000, [(key, due.lease_epoch)], 240_000) == (True, {key}, set())
    assert await db.fetchval("SELECT live_until FROM runners WHERE owner = $1", OWNER) > live_until
    assert (await row(db, due_id))["lease_expires_at"] > leases[due_id]
    assert (await row(db, other_id))["lease_expires_at"] == leases[other_id]


async def test_a_beat_does_not_revive_a_lapsed_row_and_a_lapsed_runner_claims_nothing(
    stores: tuple[TaskStore, RunnerStore], db: asyncpg.Connection
) -> None:
    """Once a runner's row lapsed the reaper may have taken its tasks: a late beat must not make
    its old runs count again (it says the row was not extended, and renews no task), and a claim
    must not lease new tasks under it. Publishing afresh (after stopping every run) revives it."""
    tasks, runner = stores
    held_id = await queued(tasks)
    held = await claim_one(runner)
    waiting_id = await queued(tasks)
    await lapse_row(db)
    before = (await row(db, held_id))["lease_expires_at"]
    key = (held.tenant_id, held_id)
    assert await runner.renew(OWNER, 60_000, [(key, held.lease_epoch)], 240_000) == (False, set(), set())
    assert await db.fetchval("SELECT live_until < now() FROM runners WHERE owner = $1", OWNER)
    assert (await row(db, held_id))["lease_expires_at"] == before
    assert await runner.claim(OWNER, 240_000, 1, {"echo": None}, tenant_share=32, held={}) == []
    assert (await row(db, waiting_id))["lease_owner"] is None
    await runner.publish(OWNER, {}, 60_000)
    assert (await claim_one(runner)).task_id == waiting_id


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


async def test_a_running_runner_beats_one_row_and_renews_a_tasks_own_lease_once_a_lease(
    database_url: str, db: asyncpg.Connection, http: httpx.AsyncClient
) -> None:
    """Issue 15 (docs/decisions.md, "Fencing"): every eighth of the lease the runner extends its row
    (the lease on all its tasks), and a running task's own row is written only once its lease is a
    lease old, not on every beat."""
    key = secrets.token_hex(4)
    async with serve(make_settings(database_url, lease_ms=2_000)) as running:  # a beat every 0.25 s
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("hang", {"key": key}))["task"]["taskId"]
        async with asyncio.timeout(10):
            await signal(key, "started").wait()
        first = (await row(db, task_id))["lease_expires_at"]
        seen = await beats(db, 4, task_id)
        assert [b["live_until"] for b in seen] == sorted({b["live_until"] for b in seen})  # each moved it on
        assert [b["lease_expires_at"] for b in seen] == [first] * len(seen)  # four beats, no task write
        async with asyncio.timeout(10):
            while (await row(db, task_id))["lease_expires_at"] == first:
                await asyncio.sleep(0.1)
        await s.result("tasks/cancel", {"taskId": task_id})


async def test_a_run_whose_row_is_locked_elsewhere_is_fenced_alone_and_the_beats_go_on(
    database_url: str, db: asyncpg.Connection, http: httpx.AsyncClient
) -> None:
    """A transaction left open on one task row: the beats skip that row (it is not renewed, so
    that run alone is fenced once its cover runs out), the runner's row and the other run are
    renewed throughout, and the fenced run's hand-back, which waits for the lock, holds up no beat.
    Before, the beat waited on the row, failed, and every run of the runner was fenced."""
    locked_key, free_key = secrets.token_hex(4), secrets.token_hex(4)
    async with serve(make_settings(database_url, lease_ms=2_000)) as running:  # a beat every 0.25 s
        s = RpcSession(http, running.url)
        await s.initialize()
        locked_id = (await s.call_tool_as_task("hang", {"key": locked_key}))["task"]["taskId"]
        free_id = (await s.call_tool_as_task("hang", {"key": free_key}))["task"]["taskId"]
        async with asyncio.timeout(10):
            await signal(locked_key, "started").wait()
            await signal(free_key, "started").wait()
        holder = await asyncpg.connect(database_url)
        try:
            await holder.execute("BEGIN")
            await holder.execute("SELECT 1 FROM tasks WHERE task_id = $1 FOR UPDATE", locked_id)
            async with asyncio.timeout(15):  # its own lease is due after 2 s, its cover gone 1.5 s later
                await signal(locked_key, "cancelled").wait()
            # Its hand-back now waits for the lock: the beats do not, and they keep covering the other run.
            seen = await beats(db, 3, free_id)
            assert [b["live_until"] for b in seen] == sorted({b["live_until"] for b in seen})
            assert not signal(free_key, "cancelled").is_set()
            free_lease = (await row(db, free_id))["lease_expires_at"]
        finally:
            await holder.close()
        async with asyncio.timeout(10):  # once the lock is gone, the fenced run is given back
            while (await row(db, locked_id))["status"] == "working":
                await asyncio.sleep(0.1)
        assert (await row(db, free_id))["status"] == "working"
        assert not signal(free_key, "cancelled").is_set()
        async with asyncio.timeout(10):  # and the other run's own lease is still renewed
            while (await row(db, free_id))["lease_expires_at"] == free_lease:
                await asyncio.sleep(0.1)
        await s.result("tasks/cancel", {"taskId": free_id})


async def test_a_runner_whose_row_lapsed_stops_its_tools_and_publishes_itself_afresh(
    database_url: str, db: asyncpg.Connection, http: httpx.AsyncClient
) -> None:
    """Its tasks may already be the reaper's: its next beat (which does not revive the row) stops
    every tool still running, the task goes back (hang may not re-run: failed), and the runner
    publishes a fresh row for new work."""
    key = secrets.token_hex(4)
    async with serve(make_settings(database_url, lease_ms=2_000)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("hang", {"key": key}))["task"]["taskId"]
        async with asyncio.timeout(10):
            await signal(key, "started").wait()
        before = fenced_tasks()
        await db.execute("UPDATE runners SET live_until = now() - interval '1 second'")
        async with asyncio.timeout(5):
            await signal(key, "cancelled").wait()
        assert fenced_tasks() == before + 1
        async with asyncio.timeout(10):
            while (await row(db, task_id))["status"] != "failed":
                await asyncio.sleep(0.05)
            while not await db.fetchval("SELECT live_until > now() FROM runners"):
                await asyncio.sleep(0.05)
        echoed = await s.call_tool_as_task("echo", {"text": "after"})
        async with asyncio.timeout(10):
            result = await s.result("tasks/result", {"taskId": echoed["task"]["taskId"]})
        assert result["content"][0]["text"] == "after"


async def test_the_tasks_of_a_claim_whose_answer_was_lost_are_taken_over_after_a_lease_and_a_half(
    database_url: str, db: asyncpg.Connection, http: httpx.AsyncClient
) -> None:
    """A claim that committed but whose answer never came leaves its tasks leased to a live runner
    that does not run them: they wait for their own lease, which a claim sets to a lease and a half
    (CLAIM_LEASE; the next beat would extend a run's to four), then the reaper gives them back and
    they run once (docs/decisions.md, "Fencing")."""
    async with serve(make_settings(database_url, lease_ms=2_000)) as running:
        runner = running.app.state.core.runner
        claim = runner.store.claim
        lost: list[str] = []

        async def answer_lost(*args: Any, **kwargs: Any) -> list[Task]:
            tasks: list[Task] = await claim(*args, **kwargs)
            if tasks and not lost:
                lost.extend(t.task_id for t in tasks)
                raise Unavailable("the claim's answer was lost")
            return tasks

        runner.store.claim = answer_lost  # type: ignore[method-assign]
        runner.reserve = lambda tenant_id, *, running=False: None  # type: ignore[method-assign]  # via a claim
        s = RpcSession(http, running.url)
        await s.initialize()
        created = time.monotonic()
        task_id = (await s.call_tool_as_task("echo", {"text": "once"}))["task"]["taskId"]
        async with asyncio.timeout(10):
            while not lost:
                await asyncio.sleep(0.01)
        left = await db.fetchval(
            "SELECT extract(epoch FROM lease_expires_at - clock_timestamp()) FROM tasks WHERE task_id = $1", task_id
        )
        assert left is None or float(left) <= 3.0  # a lease and a half of 2 s (None: taken over already)
        async with asyncio.timeout(15):
            result = await s.result("tasks/result", {"taskId": task_id})
        taken_over_after = time.monotonic() - created
        assert lost == [task_id]
        assert result["content"][0]["text"] == "once"
        assert (await row(db, task_id))["attempts"] == 2  # the lost claim's, and the one it ran under
        assert taken_over_after < 7.5, "waited for four leases (8 s), not a lease and a half (3 s)"


async def test_a_run_fenced_while_it_reads_its_session_goes_back_to_the_queue_whatever_its_tool(
    database_url: str, db: asyncpg.Connection, http: httpx.AsyncClient
) -> None:
    """A run fenced before its tool was called (here while it reads what its session's client
    declared, its row locked elsewhere so that no beat covers it) never ran the tool: once the
    lock is gone its task goes back to the queue even though `hang` may not run twice, and is
    claimed again. Before, the fenced run was given back as if its tool had run: failed."""
    async with (
        serve(make_settings(database_url, runner_concurrency=0)) as front,
        serve(make_settings(database_url, lease_ms=4_000)) as worker,  # the reaper's turn comes 3 s after the fence
    ):
        reads = asyncio.Queue[str]()

        async def never_answers(tenant_id: str, session_id: str) -> dict[str, object]:
            reads.put_nowait(session_id)
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        worker.app.state.core.runner.store.session_capabilities = never_answers
        s = RpcSession(http, front.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        async with asyncio.timeout(10):
            await reads.get()
        before = fenced_tasks()
        holder = await asyncpg.connect(database_url)
        try:
            await holder.execute("BEGIN")
            await holder.execute("SELECT 1 FROM tasks WHERE task_id = $1 FOR UPDATE", task_id)
            async with asyncio.timeout(15):  # not renewed once due: fenced when its cover is gone
                while fenced_tasks() == before:
                    await asyncio.sleep(0.05)
        finally:
            await holder.close()
        async with asyncio.timeout(15):
            await reads.get()  # given back to the queue and claimed again: its read begins anew
        assert (await row(db, task_id))["status"] == "working"
        await s.result("tasks/cancel", {"taskId": task_id})
