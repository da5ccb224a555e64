"""Group commit: concurrent requests share one statement and one commit, and still get exactly the
answers, isolation and audit events they would get alone (a single request is a batch of one)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY

from service.domain.errors import InvalidArguments, Unavailable
from service.domain.principal import Caller, Principal
from service.domain.task import Outcome, OutcomeKind, Task
from service.store import requests as rq
from service.store.batch import Batcher
from service.store.db import APP_ROLE, RUNNER_ROLE, Database
from service.store.queries import Q
from service.store.runners import RunnerStore
from service.store.tasks import TaskStore
from tests.conftest import make_settings, run_issuer, serve
from tests.issuer import LocalIssuer
from tests.rpc import RpcSession
from tests.test_audit import assert_linked_without_gaps, audit_rows


def fallbacks(name: str) -> float:
    return REGISTRY.get_sample_value("mcp_tasks_db_batch_fallbacks_total", {"batch": name}) or 0.0


@pytest.fixture
async def app_db(database_url: str) -> AsyncIterator[Database]:
    db = Database(database_url, pool_size=2, role=APP_ROLE)
    await db.open()
    try:
        yield db
    finally:
        await db.close()


def principal(tenant: str, subject: str) -> Principal:
    return Principal(tenant_id=tenant, subject=subject, client_id="c", issuer="https://issuer.test")


def create(owner: Principal, *, text: str = "x", max_per_requestor: int = 100) -> rq.CreateRequest:
    return rq.create(
        Caller(owner, "r", "127.0.0.1"),
        secrets.token_urlsafe(16),
        tool="echo",
        arguments={"text": text},
        wire="2025-11-25",
        session_id=None,
        client_capabilities={},
        progress_token=None,
        ttl_ms=60_000,
        poll_interval_ms=100,
        max_per_requestor=max_per_requestor,
        max_per_tenant=1_000,
        lease=None,
        rerunnable=True,
        tool_version=None,
    )


def leased_create(owner: Principal) -> rq.CreateRequest:
    return dataclasses.replace(create(owner), lease_owner="runner-1", lease_ms=60_000)


def lookup(owner: Principal, task_id: str, *, retrieve: bool) -> rq.GetRequest | rq.RetrieveRequest:
    return rq.retrieve(Caller(owner), task_id) if retrieve else rq.get(Caller(owner), task_id)


def finish(task: Task, owner: str, outcome: Outcome) -> rq.FinishRequest:
    return rq.FinishRequest.of(task.tenant_id, task.task_id, task.subject, owner, outcome, epoch=task.lease_epoch)


class Recorded:
    """The batch statement as the service wires it, on a real database, recording batch sizes."""

    def __init__(self, db: Database) -> None:
        self.store = TaskStore(db)
        self.sizes: list[int] = []

    async def many(self, items: list[Any]) -> list[Task | None]:
        """Each batcher carries one operation: creates, retrieves or gets."""
        self.sizes.append(len(items))
        if isinstance(items[0], rq.CreateRequest):
            return await self.store.create(items)
        if isinstance(items[0], rq.RetrieveRequest):
            return await self.store.retrieve(items)
        return await self.store.get(items)


async def test_one_batch_keeps_every_tenant_and_subject_apart_T_SEC_1(app_db: Database) -> None:
    """Items of several tenants in one statement: each sees only its own tasks, as alone."""
    calls = Recorded(app_db)
    batcher = Batcher(calls.many, name="test")
    before = fallbacks("test")
    alice, bob, mallory = principal("acme", "alice"), principal("acme", "bob"), principal("globex", "alice")
    made = await asyncio.gather(*(batcher.submit(create(p)) for p in (alice, bob, mallory)))
    assert calls.sizes == [3]
    alice_task = made[0]
    assert alice_task is not None
    assert (alice_task.tenant_id, alice_task.subject) == ("acme", "alice")
    task_id = alice_task.task_id
    lookups = [
        lookup(alice, task_id, retrieve=True),
        lookup(bob, task_id, retrieve=True),  # same tenant, another subject
        lookup(mallory, task_id, retrieve=True),  # another tenant, same subject name
        lookup(alice, task_id, retrieve=True),
    ]
    found = await asyncio.gather(*(batcher.submit(item) for item in lookups))
    assert calls.sizes == [3, 4]
    assert [t.task_id if t else None for t in found] == [task_id, None, None, task_id]
    # The same id in another tenant (ids are unique per tenant only): each tenant sees its own.
    twin = dataclasses.replace(create(mallory), task_id=task_id)
    theirs = await batcher.submit(twin)
    assert theirs is not None
    both = await asyncio.gather(
        batcher.submit(lookup(alice, task_id, retrieve=True)),
        batcher.submit(lookup(mallory, task_id, retrieve=True)),
    )
    assert [(t.tenant_id, t.subject) if t else None for t in both] == [("acme", "alice"), ("globex", "alice")]
    assert fallbacks("test") == before  # every answer came from the batch statement itself


async def test_a_batch_of_gets_answers_each_item_with_its_own_task_only_T_SEC_1(
    app_db: Database, database_url: str
) -> None:
    """task_get, as the gets batcher sends it: items of several tenants and
    subjects in one statement, each answered in its place with its own task or None: another
    subject's, another tenant's twin id, an expired task and an unknown id find nothing; the same
    item twice is answered twice; RLS holds each tenant's read to its rows."""
    store = TaskStore(app_db)
    alice, bob, mallory = principal("acme", "alice"), principal("acme", "bob"), principal("globex", "alice")
    mine = await store.create([create(alice), create(alice)])
    assert mine[0] is not None
    assert mine[1] is not None
    twin = await store.create([dataclasses.replace(create(mallory), task_id=mine[0].task_id)])
    assert twin[0] is not None
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute(
            "UPDATE tasks SET expires_at = clock_timestamp() - interval '1 second' WHERE tenant_id = $1 AND task_id = $2",
            "acme",
            mine[1].task_id,
        )
    finally:
        await admin.close()
    a, expired = mine[0].task_id, mine[1].task_id
    items = [
        lookup(alice, a, retrieve=False),
        lookup(bob, a, retrieve=False),  # same tenant, another subject
        lookup(mallory, a, retrieve=False),  # the twin in another tenant: its own task
        lookup(alice, expired, retrieve=False),
        lookup(alice, "no-such-task", retrieve=False),
        lookup(alice, a, retrieve=False),  # the same item again
        lookup(principal("initech", "alice"), a, retrieve=False),  # a tenant with no such task
    ]
    found = await store.get(sorted(items, key=lambda item: item.order))
    by_item = dict(zip((id(i) for i in sorted(items, key=lambda item: item.order)), found, strict=True))
    answers = [by_item[id(i)] for i in items]
    assert [(t.tenant_id, t.subject, t.task_id) if t else None for t in answers] == [
        ("acme", "alice", a),
        None,
        ("globex", "alice", a),
        None,
        None,
        ("acme", "alice", a),
        None,
    ]
    assert all(t is None or t.status.value == "working" for t in answers)
    # In any order the batcher might send (it sorts; the statement must not depend on it).
    assert [t.tenant_id if t else None for t in await store.get(list(reversed(items)))] == [
        None, "acme", None, None, "globex", None, "acme",
    ]  # fmt: skip


async def test_a_bad_item_fails_alone_and_the_rest_of_its_batch_is_created(app_db: Database, database_url: str) -> None:
    """Text PostgreSQL cannot store fails the whole statement; each item is then tried alone."""
    calls = Recorded(app_db)
    batcher = Batcher(calls.many, name="test")
    owner = principal("acme", "alice")
    items = [create(owner, text="ok-1"), create(owner, text="bad\u0000"), create(owner, text="ok-2")]
    before = fallbacks("test")
    outcomes = await asyncio.gather(*(batcher.submit(item) for item in items), return_exceptions=True)
    assert calls.sizes == [3, 1, 1, 1]  # refused whole, then each item as a batch of one
    assert fallbacks("test") == before + 1
    assert isinstance(outcomes[1], InvalidArguments)
    assert [o.arguments["text"] for o in (outcomes[0], outcomes[2]) if isinstance(o, Task)] == ["ok-1", "ok-2"]
    rows = await audit_rows(database_url, "acme")
    assert sorted(e["task_id"] for e in rows) == sorted([items[0].task_id, items[2].task_id])
    assert_linked_without_gaps(rows)


async def test_caps_count_the_creates_ahead_in_the_same_batch_T_SEC_7(app_db: Database) -> None:
    calls = Recorded(app_db)
    batcher = Batcher(calls.many, name="test")
    owner = principal("acme", "alice")
    before = fallbacks("test")
    made = await asyncio.gather(*(batcher.submit(create(owner, max_per_requestor=2)) for _ in range(5)))
    assert calls.sizes == [5]
    assert sum(t is not None for t in made) == 2
    assert fallbacks("test") == before


async def test_caps_hold_across_requestors_of_one_tenant_in_one_batch_T_SEC_7(app_db: Database) -> None:
    """Issue 15: a batch reads the counters once per run of one requestor's creates and counts on
    itself; the next requestor's run reads again and still sees the tenant's total so far."""
    calls = Recorded(app_db)
    batcher = Batcher(calls.many, name="test")
    alice, bob = principal("acme", "alice"), principal("acme", "bob")

    def capped(owner: Principal) -> rq.CreateRequest:
        return dataclasses.replace(create(owner, max_per_requestor=2), max_per_tenant=3)

    made = await asyncio.gather(*(batcher.submit(capped(p)) for p in (alice, bob, alice, bob, alice, bob)))
    assert calls.sizes == [6]
    created = [t.subject for t in made if t is not None]
    assert sorted(created) == ["alice", "alice", "bob"]  # alice's run first (sorted), then the tenant's cap
    again = await batcher.submit(capped(bob))
    assert again is None  # the tenant is full: 3 active


async def test_finishes_in_one_batch_record_only_leases_still_held_T_SEC_10(
    app_db: Database, database_url: str
) -> None:
    owner = principal("acme", "alice")
    leased = [leased_create(owner) for _ in range(3)]
    tasks = [t for t in await TaskStore(app_db).create(leased) if t is not None]
    assert len(tasks) == 3
    outcome = Outcome(OutcomeKind.RESULT, {"content": [], "isError": False})
    items = [
        finish(tasks[0], "runner-1", outcome),
        finish(tasks[1], "runner-2", outcome),  # not its lease
        finish(tasks[2], "runner-1", outcome),
    ]
    runner_db = Database(database_url, pool_size=1, role=RUNNER_ROLE)
    await runner_db.open()
    try:
        done = await RunnerStore(runner_db).finish(items)
    finally:
        await runner_db.close()
    assert [t.status.value if t else None for t in done] == ["completed", None, "completed"]
    rows = await audit_rows(database_url, "acme")
    completed = {e["task_id"] for e in rows if e["action"] == "complete"}
    assert completed == {tasks[0].task_id, tasks[2].task_id}
    assert_linked_without_gaps(rows)


async def test_concurrent_lifecycles_of_many_tenants_share_commits_and_keep_their_audit_T_SEC_10(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Through HTTP: creates, gets, results and finishes of 3 tenants with 2 subjects each at once. Every
    answer is the caller's own, every probe of another's task is 'not found', every chain verifies."""
    async with run_issuer(LocalIssuer()) as issuer:
        settings = make_settings(database_url, auth="oauth", oauth_issuer=issuer.url)
        async with serve(settings) as running:
            owners = [(t, s) for t in ("acme", "globex", "initech") for s in ("alice", "bob")]
            sessions = {}
            for tenant, sub in owners:
                sessions[(tenant, sub)] = RpcSession(
                    http, running.url, token=issuer.mint(running.url, sub=sub, tenant_id=tenant)
                )
                await sessions[(tenant, sub)].initialize()
            before = {name: fallbacks(name) for name in ("writes", "reads", "finishes")}

            async def lifecycle(owner: tuple[str, str], n: int) -> tuple[str, dict[str, Any]]:
                s = sessions[owner]
                text = f"{owner[0]}/{owner[1]}/{n}"
                task_id = (await s.call_tool_as_task("echo", {"text": text}))["task"]["taskId"]
                assert (await s.result("tasks/get", {"taskId": task_id}))["taskId"] == task_id
                result = await s.result("tasks/result", {"taskId": task_id})
                assert result["content"][0]["text"] == text
                return task_id, result

            done = await asyncio.gather(*(lifecycle(o, n) for o in owners for n in range(6)))
            # Every task, probed by every other principal at once: not found, as if it did not exist.
            probes = [
                (sessions[other], task_id)
                for (task_id, _r), owner in zip(done, [o for o in owners for _ in range(6)], strict=True)
                for other in owners
                if other != owner
            ]
            errors = await asyncio.gather(*(s.error("tasks/get", {"taskId": t}) for s, t in probes))
            assert {e["code"] for e in errors} == {-32602}
            # Every answer came from batch statements, none from the item-by-item fallback.
            assert {name: fallbacks(name) for name in before} == before
    for tenant in ("acme", "globex", "initech"):
        rows = await audit_rows(database_url, tenant)
        assert_linked_without_gaps(rows)
        for action in ("create", "complete", "retrieve"):
            assert len([e for e in rows if e["action"] == action]) == 12, (tenant, action)
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetch(Q["audit_chain_problems"], None) == []
    finally:
        await conn.close()


async def test_a_request_whose_waiter_went_away_is_not_sent(app_db: Database) -> None:
    """A cancelled tasks/result must not be audited as a hand-out nobody received."""
    calls = Recorded(app_db)
    batcher = Batcher(calls.many, name="test")
    owner = principal("acme", "alice")
    task = await batcher.submit(create(owner))
    assert task is not None
    gone = batcher.enqueue(lookup(owner, task.task_id, retrieve=True))
    kept = batcher.enqueue(lookup(owner, task.task_id, retrieve=True))
    gone.cancel()
    assert (await kept) is not None
    assert calls.sizes == [1, 1]


async def test_a_batch_cut_off_by_shutdown_answers_every_waiter(app_db: Database) -> None:
    """Cancelled (shutdown) while answering a refused batch item by item: every waiter still gets
    an answer, those not yet answered an Unavailable."""
    gate = asyncio.Event()
    calls = Recorded(app_db)

    async def held_after_first(items: list[rq.CreateRequest]) -> list[Task | None]:
        if calls.sizes:  # the item-by-item answers: held until the shutdown comes
            await gate.wait()  # never set
        return await calls.many(items)

    batcher = Batcher(held_after_first, name="test")
    owner = principal("acme", "alice")
    # PostgreSQL refuses the whole batch (text it cannot store), so it goes item by item.
    before = fallbacks("test")
    waiting = [batcher.enqueue(create(owner)), batcher.enqueue(create(owner, text="bad\u0000"))]
    async with asyncio.timeout(10):
        while fallbacks("test") == before:  # the batch was refused; the first item is on its way
            await asyncio.sleep(0.01)
        queued = batcher.enqueue(create(owner))
        drainer = batcher._drainers[0]  # the small lane
        assert drainer is not None
        drainer.cancel()
        outcomes = await asyncio.gather(*waiting, queued, return_exceptions=True)
    assert [type(o).__name__ for o in outcomes] == ["Unavailable"] * 3


async def test_a_finish_batch_locks_every_row_before_any_counter(app_db: Database, database_url: str) -> None:
    """A cancel locks its task's row, then its requestor's counter. A finish batch that changed one
    task (locking the counter) and then waited for the cancelled task's row would close a cycle."""
    owner = principal("acme", "alice")
    leased = [leased_create(owner) for _ in range(2)]
    tasks = sorted((t for t in await TaskStore(app_db).create(leased) if t is not None), key=lambda t: t.task_id)
    outcome = Outcome(OutcomeKind.RESULT, {"content": [], "isError": False})
    items = [finish(t, "runner-1", outcome) for t in tasks]
    blocker = await asyncpg.connect(database_url)
    runner_db = Database(database_url, pool_size=1, role=RUNNER_ROLE)
    await runner_db.open()
    try:
        async with blocker.transaction():
            # The second task's row is held, as by a cancel in progress.
            await blocker.execute("SELECT 1 FROM tasks WHERE task_id = $1 FOR UPDATE", tasks[1].task_id)

            finishing = asyncio.create_task(RunnerStore(runner_db).finish(items))
            probe = await asyncpg.connect(database_url)
            try:
                async with asyncio.timeout(10):
                    while not await probe.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock' AND query LIKE '%task_finish%'"
                    ):
                        await asyncio.sleep(0.02)
                async with probe.transaction():
                    # The counter is free while the batch waits: it changed nothing yet.
                    await probe.execute(
                        "SELECT 1 FROM active_tasks WHERE tenant_id = 'acme' AND subject = 'alice' FOR UPDATE NOWAIT"
                    )
            finally:
                await probe.close()
        done = await finishing
    finally:
        await blocker.close()
        await runner_db.close()
    assert [t.status.value if t else None for t in done] == ["completed", "completed"]


async def test_requests_under_way_join_the_next_batch_and_an_idle_one_goes_after_one_turn(
    app_db: Database,
) -> None:
    """Before a batch goes out, the loop turns while each turn brings more items (at most
    GATHER_TURNS): requests arriving over a few loop turns share one statement, where before the
    first went alone. A request on an idle service still goes after a single turn."""
    store = TaskStore(app_db)
    sizes: list[int] = []

    async def recorded(items: list[rq.CreateRequest]) -> list[Task | None]:
        sizes.append(len(items))
        return await store.create(items)

    batcher = Batcher(recorded, name="test-gather")
    owner = principal("gather", "a")
    futures = [batcher.enqueue(create(owner))]
    for _ in range(3):  # one more request per loop turn, as requests under way would add them
        await asyncio.sleep(0)
        futures.append(batcher.enqueue(create(owner)))
    async with asyncio.timeout(10):
        created = await asyncio.gather(*futures)
    assert all(t is not None for t in created)
    assert sizes == [4]
    sizes.clear()
    async with asyncio.timeout(10):
        alone = batcher.enqueue(create(owner))
        turns = 0
        while not sizes:  # the drainer sends it after one turn without more items
            await asyncio.sleep(0)
            turns += 1
        assert await alone is not None
    assert sizes == [1]
    assert turns <= 3


async def test_tenants_take_turns_and_large_items_go_in_a_lane_of_their_own(app_db: Database) -> None:
    """Issue 14 finding 6: behind a statement in flight, one tenant's 100 queued creates do not
    push another tenant's create out of the next batch; a large item never shares a statement with
    small ones, and large items are batched up to MAX_BATCH_BYTES (one ~900 KB item alone)."""
    gate = asyncio.Event()
    batches: list[list[str]] = []
    store = TaskStore(app_db)

    async def gated(items: list[rq.CreateRequest]) -> list[Task | None]:
        batches.append([f"{i.tenant_id}:{'large' if i.size_bytes > 65_536 else 'small'}" for i in items])
        if len(batches) == 1:
            await gate.wait()  # the statement in flight while the flood queues
        return await store.create(items)

    batcher = Batcher(gated, name="test-turns")
    flood, other = principal("flood", "a"), principal("other", "b")
    first = batcher.enqueue(create(flood))
    async with asyncio.timeout(10):
        while not batches:
            await asyncio.sleep(0.01)
    queued = [batcher.enqueue(create(flood, max_per_requestor=1_000)) for _ in range(100)]
    mine = batcher.enqueue(create(other))
    large = [batcher.enqueue(create(flood, text="x" * 900_000, max_per_requestor=1_000)) for _ in range(2)]
    gate.set()
    async with asyncio.timeout(30):
        results = await asyncio.gather(first, *queued, mine, *large)
    assert all(task is not None for task in results)
    small = [b for b in batches if all(i.endswith(":small") for i in b)]
    assert "other:small" in small[1]  # the first batch after the one in flight
    assert [b for b in batches if b not in small] == [["flood:large"], ["flood:large"]]


async def backend(db: Database) -> int:
    pid: int = await db.fetchval("SELECT pg_backend_pid()")
    return pid


async def test_a_drain_keeps_one_connection_for_its_statements_and_gives_it_back(app_db: Database) -> None:
    """Database.holding (a batcher's drain): the statements of the holding task share one pooled
    connection, held between them and given back when the block ends; a failed statement gives it
    back at once (the next one takes another); a statement begun while it is busy, or one of another
    task, takes its own."""
    async with app_db.holding():
        first = await backend(app_db)
        assert app_db.pool_usage()[0] == 1  # held between statements
        assert await backend(app_db) == first
        async with app_db.connection() as outer, app_db.connection() as inner:  # nested: busy
            assert outer is not inner
            assert await outer.fetchval("SELECT 1") == await inner.fetchval("SELECT 1") == 1
        other = asyncio.create_task(backend(app_db))  # another task: its own connection from the pool
        assert await other > 0
        assert app_db.pool_usage()[0] == 1
        with pytest.raises(asyncpg.DivisionByZeroError):
            await app_db.fetchval("SELECT 1 / 0")
        assert app_db.pool_usage()[0] == 0  # given back with the failure
        assert await backend(app_db) > 0
        assert app_db.pool_usage()[0] == 1
    assert app_db.pool_usage()[0] == 0


async def test_a_burst_of_batches_goes_over_one_connection(app_db: Database) -> None:
    """The reads of a burst, drained batch after batch, use one connection (one acquire and one
    release for the burst); an idle batcher holds none."""
    pids: list[int] = []

    async def run_many(items: list[rq.GetRequest]) -> list[int]:
        pid = await backend(app_db)
        pids.append(pid)
        await asyncio.sleep(0.01)  # a statement in flight: the next ones queue up meanwhile
        return [pid] * len(items)

    batcher: Batcher[rq.GetRequest, int] = Batcher(run_many, name="test-hold", max_items=2, hold=app_db.holding)
    owner = principal("acme", "alice")
    gets = [rq.get(Caller(owner, "r", "127.0.0.1"), f"t{i}") for i in range(8)]
    before = acquires()
    assert len(set(await asyncio.gather(*(batcher.submit(g) for g in gets)))) == 1
    assert len(pids) == 4
    assert acquires() == before + 1
    assert app_db.pool_usage()[0] == 0


def acquires() -> float:
    return REGISTRY.get_sample_value("mcp_tasks_db_pool_acquire_seconds_count", {"pool": "app"}) or 0.0


async def test_an_item_queued_while_a_drain_gives_its_hold_back_is_still_sent() -> None:
    """Giving the hold back is an await: an item queued meanwhile finds the drainer still there, so
    the drainer must take it (it was answered "shutting down" once, unsent)."""
    giving_back = asyncio.Event()

    @contextlib.asynccontextmanager
    async def slow_hold() -> AsyncIterator[None]:
        yield
        giving_back.set()
        await asyncio.sleep(0.05)

    async def run_many(items: list[rq.GetRequest]) -> list[str]:
        return [item.task_id for item in items]

    batcher: Batcher[rq.GetRequest, str] = Batcher(run_many, name="test-hold-race", hold=slow_hold)
    caller = Caller(principal("acme", "alice"), "r", "127.0.0.1")
    first = asyncio.create_task(batcher.submit(rq.get(caller, "t1")))
    async with asyncio.timeout(5):
        await giving_back.wait()
        assert await batcher.submit(rq.get(caller, "t2")) == "t2"
        assert await first == "t1"


async def test_a_failed_item_reaches_its_waiter_and_an_abandoned_one_is_not_logged() -> None:
    """An item's exception goes to whoever awaits it; one whose waiter went away under a shield is
    not reported as "never retrieved" when its future is collected (nobody was left to take it)."""
    import gc

    async def run_many(items: list[rq.GetRequest]) -> list[str]:
        raise Unavailable("the database went away")

    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        batcher: Batcher[rq.GetRequest, str] = Batcher(run_many, name="test-unretrieved")
        caller = Caller(principal("acme", "alice"), "r", "127.0.0.1")
        with pytest.raises(Unavailable):
            await batcher.submit(rq.get(caller, "t1"))

        async def wait_shielded() -> None:
            await asyncio.shield(batcher.enqueue(rq.get(caller, "t2")))

        abandoned = asyncio.create_task(wait_shielded())
        await asyncio.sleep(0)
        abandoned.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await abandoned
        async with asyncio.timeout(5):
            while batcher._drainers[0] is not None:  # the batch ran and failed, with nobody waiting
                await asyncio.sleep(0.01)
        del abandoned
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert [c for c in reported if "never retrieved" in str(c.get("message"))] == []


async def test_a_held_connection_killed_between_statements_is_replaced(app_db: Database, database_url: str) -> None:
    """The server ended the held connection between two batches (a failover, pg_terminate_backend):
    the next statement does not fail on it, it goes through the pool as any other."""
    async with app_db.holding():
        first = await backend(app_db)
        admin = await asyncpg.connect(database_url)
        try:
            assert await admin.fetchval("SELECT pg_terminate_backend($1)", first)
        finally:
            await admin.close()
        await asyncio.sleep(0.2)  # the driver reads the server's goodbye
        assert await backend(app_db) != first


async def test_a_pool_closing_under_a_hold_gets_the_held_connection_back(database_url: str) -> None:
    """Closing the pool waits for every connection: the held one goes back at the drain's next
    statement (which finds the pool closing and fails as any statement would then), so the close
    ends while a burst is still draining."""
    db = Database(database_url, pool_size=2, role=APP_ROLE)
    await db.open()
    async with db.holding():
        await backend(db)
        closing = asyncio.create_task(db.close())
        # Waiting for the held connection: no event says so, only that the close has not ended (one
        # that did not wait would end as soon as it closed the connections, well within this).
        done, _ = await asyncio.wait({closing}, timeout=0.5)
        assert not done
        with pytest.raises(Unavailable):
            await backend(db)
        async with asyncio.timeout(5):
            await closing


async def ended_with_its_outcome_held(s: RpcSession, admin: asyncpg.Connection) -> tuple[str, Any]:
    """A `stubborn` task whose tool has returned while ``admin`` holds its row locked: its outcome
    write waits until the returned transaction ends. The lock is taken once the tool runs (a
    claim, had the task been queued, would write its row and wait too)."""
    from tests.toolpack import signal

    key = secrets.token_hex(4)
    task_id = (await s.call_tool_as_task("stubborn", {"seconds": 0.5, "key": key}))["task"]["taskId"]
    async with asyncio.timeout(10):
        await signal(key, "started").wait()
    lock = admin.transaction()
    await lock.start()
    await admin.execute("SELECT 1 FROM tasks WHERE task_id = $1 FOR UPDATE", task_id)
    async with asyncio.timeout(10):
        await signal(key, "returned").wait()
    return task_id, lock


async def test_a_run_whose_tool_ended_gives_its_slot_back_before_its_outcome_is_written(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """A runner slot is a tool running, not an outcome on its way: with one slot, a second task
    starts while the first one's outcome write still waits (here behind a row lock held by another
    transaction), and the first outcome lands once the lock goes. Before, the slow write held the
    only slot, and every later task waited for it."""
    from tests.toolpack import signal

    second_key = secrets.token_hex(4)
    admin = await asyncpg.connect(database_url)
    try:
        async with serve(make_settings(database_url, runner_concurrency=1)) as running:
            s = RpcSession(http, running.url)
            await s.initialize()
            first, lock = await ended_with_its_outcome_held(s, admin)
            second = (await s.call_tool_as_task("hang", {"key": second_key}))["task"]["taskId"]
            async with asyncio.timeout(5):
                await signal(second_key, "started").wait()
            status = await admin.fetchval("SELECT status FROM tasks WHERE task_id = $1", first)
            assert status == "working"  # its outcome is still waiting for the lock
            await lock.rollback()
            async with asyncio.timeout(10):
                result = await s.result("tasks/result", {"taskId": first})
            assert result["content"][0]["text"] == "finished anyway"
            await s.result("tasks/cancel", {"taskId": second})
    finally:
        await admin.close()
