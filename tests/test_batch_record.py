"""Issue 15, point 2: a batch appends each tenant's audit events once and changes
each requestor's active-task counter once, with the record and the counters exactly as one item at
a time would leave them: chains that verify, seqs in item order without gaps, counters equal to a
real count after every kind of writer, the retrieve interval unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from service.store.queries import Q

APP, RUNNER = "mcp_tasks_app", "mcp_tasks_runner"
LEASE = "runner-1"


def create(tenant: str, subject: str, **fields: Any) -> dict[str, Any]:
    return {
        "k": "create", "tenant_id": tenant, "task_id": secrets.token_urlsafe(12), "subject": subject,
        "issuer": "https://issuer.test", "client_id": "c", "session_id": None, "wire": "2025-11-25",
        "tool": "echo", "arguments": {"text": "x"}, "client_capabilities": {}, "progress_token": None,
        "ttl_ms": 600_000, "poll_interval_ms": 100, "max_per_requestor": 1_000, "max_per_tenant": 10_000,
        "request_id": "r", "client_address": "127.0.0.1", "detail": {"tool": "echo"},
        "lease_owner": LEASE, "lease_ms": 600_000, "rerunnable": True, "tool_version": None,
    } | fields  # fmt: skip


def ordered(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As the batcher sends them (service/store/batch.py): in (tenant, subject, task) order."""
    return sorted(items, key=lambda i: (i["tenant_id"], i["subject"], i["task_id"]))


def finish(item: dict[str, Any], owner: str = LEASE) -> dict[str, Any]:
    return {
        "tenant_id": item["tenant_id"], "task_id": item["task_id"], "owner": owner, "status": "completed",
        "outcome": "result", "payload": {"content": [], "isError": False}, "status_message": None,
        "detail": {"outcome": "result"}, "epoch": 0, "subject": item["subject"],
    }  # fmt: skip


def retrieve(item: dict[str, Any]) -> dict[str, Any]:
    return item | {"k": "retrieve", "detail": None}


@pytest.fixture
async def admin(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def as_role(
    conn: asyncpg.Connection, role: str, sql: str, *args: Any, tenant: str | None = None
) -> list[asyncpg.Record]:
    """One statement in its own transaction as the service's role (its login user is a superuser here)."""
    async with conn.transaction():
        await conn.execute(f"SET LOCAL ROLE {role}")
        if tenant is not None:
            await conn.execute("SELECT set_config('app.tenant_id', $1, true)", tenant)
        return await conn.fetch(sql, *args)


async def batch(conn: asyncpg.Connection, items: list[dict[str, Any]]) -> list[asyncpg.Record]:
    """Creates (task_create) or retrieves (task_retrieve), as the app role sends them."""
    function = "task_retrieve" if items and items[0].get("k") == "retrieve" else "task_create"
    return await as_role(conn, APP, f"SELECT * FROM {function}($1::jsonb)", json.dumps(items))


async def finish_batch(conn: asyncpg.Connection, items: list[dict[str, Any]]) -> list[asyncpg.Record]:
    return await as_role(conn, RUNNER, "SELECT * FROM task_finish($1::jsonb)", json.dumps(items))


async def chain(conn: asyncpg.Connection, tenant: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT seq, at, action, task_id, detail::text AS detail FROM audit_events WHERE tenant_id = $1 ORDER BY seq",
        tenant,
    )


async def chain_problems(conn: asyncpg.Connection) -> list[tuple[str, int, str]]:
    """What `mcp-tasks audit verify` reports (AuditStore.problems), for every tenant."""
    return [(r["tenant_id"], r["seq"], r["problem"]) for r in await conn.fetch(Q["audit_chain_problems"], None)]


async def counters_match(conn: asyncpg.Connection) -> None:
    """Every requestor's counter is the real number of its active tasks (zero rows aside)."""
    counted = await conn.fetch("SELECT tenant_id, subject, active FROM active_tasks WHERE active <> 0 ORDER BY 1, 2")
    real = await conn.fetch(
        """SELECT tenant_id, subject, count(*) AS active FROM tasks WHERE task_status_active(status)
           GROUP BY 1, 2 ORDER BY 1, 2"""
    )
    assert [tuple(r) for r in counted] == [tuple(r) for r in real]


async def store_finished(conn: asyncpg.Connection, n: int) -> None:
    """``n`` finished tasks of acme/alice, inserted directly (the login user is a superuser here)."""
    await conn.execute(
        """INSERT INTO tasks (tenant_id, task_id, subject, wire, tool, arguments, status, outcome, payload,
                              ttl_ms, poll_interval_ms, expires_at, finished_at)
           SELECT 'acme', 'old-' || g, 'alice', '2025-11-25', 'echo', '{}', 'completed', 'result', '{}',
                  600000, 100, clock_timestamp() + interval '10 minutes', clock_timestamp()
           FROM generate_series(1, $1::int) g""",
        n,
    )


async def test_a_batch_of_one_tenant_appends_its_chain_in_item_order_and_it_verifies_T_SEC_10(
    admin: asyncpg.Connection,
) -> None:
    """A chain begun one event at a time (audit_append) goes on with batches: seqs follow the
    items without gaps, times never go back, and verification finds nothing."""
    await as_role(
        admin, APP, "SELECT audit_append('acme', 'deny', 'x', '', '', '', NULL, NULL, NULL, NULL)", tenant="acme"
    )
    items = ordered([create("acme", "alice") for _ in range(24)] + [create("acme", "bob") for _ in range(8)])
    rows = await batch(admin, items)
    assert [r["task_id"] for r in rows] == [i["task_id"] for i in items]
    events = await chain(admin, "acme")
    assert [e["seq"] for e in events] == list(range(1, 34))
    assert [e["task_id"] for e in events[1:]] == [i["task_id"] for i in items]
    assert all(a["at"] <= b["at"] for a, b in itertools.pairwise(events))
    done = await finish_batch(admin, [finish(i) for i in items])
    assert all(r["status"] == "completed" for r in done)
    again = await batch(admin, [retrieve(i) for i in items])
    assert [r["task_id"] for r in again] == [i["task_id"] for i in items]
    events = await chain(admin, "acme")
    assert [e["seq"] for e in events] == list(range(1, 1 + 1 + 32 * 3))
    assert [e["action"] for e in events[33:]] == ["complete"] * 32 + ["retrieve"] * 32
    assert [e["task_id"] for e in events[65:]] == [i["task_id"] for i in items]
    await as_role(
        admin, APP, "SELECT audit_append('acme', 'deny', 'y', '', '', '', NULL, NULL, NULL, NULL)", tenant="acme"
    )
    head = await admin.fetchrow("SELECT seq, encode(hash, 'hex') AS hash FROM audit_heads WHERE tenant_id = 'acme'")
    last = await admin.fetchrow("SELECT seq, encode(hash, 'hex') AS hash FROM audit_events WHERE tenant_id = 'acme' ORDER BY seq DESC LIMIT 1")  # fmt: skip
    assert tuple(head) == tuple(last) == (98, last["hash"])
    assert await chain_problems(admin) == []


async def test_a_batch_writes_each_tenants_head_and_each_requestors_counter_once(admin: asyncpg.Connection) -> None:
    """Issue 15, point 2: 32 creates (then finishes) of one requestor changed its counter and its
    tenant's audit head 32 times each in one transaction; now once per tenant and requestor."""
    items = ordered(
        [create("acme", "alice") for _ in range(20)]
        + [create("acme", "bob") for _ in range(4)]
        + [create("globex", "carol") for _ in range(8)]
    )
    await batch(admin, items[:1] + items[20:21] + items[24:25])  # the rows exist: changes are updates
    items = items[1:20] + items[21:24] + items[25:]

    async def written() -> dict[str, int]:
        # The xact view adds this transaction's writes to what earlier ones have not flushed yet.
        rows = await admin.fetch(
            """SELECT relname, n_tup_ins + n_tup_upd AS n FROM pg_stat_xact_user_tables
               WHERE relname IN ('audit_heads', 'active_tasks')"""
        )
        return {r["relname"]: r["n"] for r in rows}

    async def writes(sql: str, payload: list[dict[str, Any]], role: str) -> dict[str, int]:
        async with admin.transaction():
            before = await written()
            await admin.execute(f"SET LOCAL ROLE {role}")
            await admin.fetch(sql, json.dumps(payload))
            await admin.execute("RESET ROLE")
            after = await written()
        return {name: n - before.get(name, 0) for name, n in after.items()}

    assert await writes("SELECT * FROM task_create($1::jsonb)", items, APP) == {"audit_heads": 2, "active_tasks": 3}
    finishes = [finish(i) for i in items]
    assert await writes("SELECT * FROM task_finish($1::jsonb)", finishes, RUNNER) == {
        "audit_heads": 2,
        "active_tasks": 3,
    }
    await counters_match(admin)
    assert await chain_problems(admin) == []


async def test_counters_equal_a_real_count_after_every_kind_of_writer_T_SEC_7(admin: asyncpg.Connection) -> None:
    """Creates, finishes, cancels, hand-backs (re-queued and failed), questions and answers,
    claims, renewals and expiry deletes, of one requestor and of many, in batches and alone."""
    many = [create(f"t{t}", f"s{s}") for t in range(3) for s in range(3) for _ in range(2)]
    solo = [create("solo", "alice") for _ in range(16)]
    unleased = [create("solo", "alice", lease_owner=None, lease_ms=None) for _ in range(4)]
    await batch(admin, ordered(many + solo + unleased))
    await counters_match(admin)
    # A claim and a renewal change leases, not activity.
    await as_role(admin, RUNNER, Q["publish_runner"], LEASE, "{}", 600_000)  # its row: the lease on its tasks
    claimed = await as_role(admin, RUNNER, Q["claim_tasks"], LEASE, 600_000, 2, ["echo"], 100, [], [], "{}", [], [], [])
    assert len(claimed) == 2
    renewed = await as_role(
        admin, RUNNER, Q["renew_leases"], LEASE, 600_000,
        [i["tenant_id"] for i in solo], [i["task_id"] for i in solo], [0] * len(solo), 600_000,
    )  # fmt: skip
    assert len([r for r in renewed if r["task_id"] is not None]) == len(solo)
    await counters_match(admin)
    # Finishes, one of them not the runner's lease (nothing changes for it).
    done = await finish_batch(admin, ordered([finish(i) for i in solo[:6] + many[:5]] + [finish(solo[6], "other")]))
    assert sum(r["task_id"] is not None for r in done) == 11
    await counters_match(admin)
    # A cancel (the app role, one task per statement), and a cancel of a finished task (refused).
    for item in (solo[7], many[6], solo[0]):
        await as_role(
            admin, APP, Q["cancel_task"], item["tenant_id"], item["task_id"], item["subject"], "stop",
            tenant=item["tenant_id"],
        )  # fmt: skip
    await counters_match(admin)
    # A question and its answer: active to active.
    await admin.execute("UPDATE tasks SET status = 'input_required' WHERE task_id = $1", solo[8]["task_id"])
    await admin.execute("UPDATE tasks SET status = 'working' WHERE task_id = $1", solo[8]["task_id"])
    await counters_match(admin)
    # Hand-backs: one re-queued (stays active), one failed (no attempts left).
    released = [
        {"tenant_id": i["tenant_id"], "task_id": i["task_id"], "owner": LEASE, "rerunnable": True,
         "max_attempts": attempts, "requeue_message": "requeued", "epoch": 0, "only_if_lapsed": False,
         "failure": {"reason": "lost", "message": "the run was lost"}}
        for i, attempts in ((solo[9], 3), (solo[10], 1))
    ]  # fmt: skip
    moved = await as_role(admin, RUNNER, "SELECT * FROM task_hand_back($1::jsonb)", json.dumps(released))
    assert [r["status"] for r in moved] == ["working", "failed"]
    await counters_match(admin)
    # Expiry: active and finished tasks deleted by the sweeper.
    await admin.execute(
        "UPDATE tasks SET expires_at = clock_timestamp() - interval '1 second' WHERE task_id = ANY ($1)",
        [i["task_id"] for i in solo[:4] + solo[11:14] + many[:3] + many[10:12]],
    )
    deleted = await as_role(admin, RUNNER, Q["delete_expired_tasks"], 100)
    assert len(deleted) == 12
    await counters_match(admin)
    # And creates again after all that, capped: exactly up to the cap.
    capped = [create("solo", "alice", max_per_requestor=12) for _ in range(6)]
    made = await batch(admin, ordered(capped))
    active = await admin.fetchval(
        "SELECT count(*) FROM tasks WHERE tenant_id = 'solo' AND subject = 'alice' AND task_status_active(status)"
    )
    assert active == 12
    assert sum(r["task_id"] is not None for r in made) < 6
    await counters_match(admin)
    assert await chain_problems(admin) == []


async def test_caps_count_a_tenants_creates_not_inserted_yet_T_SEC_7(admin: asyncpg.Connection) -> None:
    """A tenant's creates go in with one INSERT at the end of its run: the caps of its next
    requestor count the ones of this batch already accepted, as before."""
    items = ordered(
        [create("acme", "alice", max_per_requestor=2, max_per_tenant=3) for _ in range(3)]
        + [create("acme", "bob", max_per_requestor=2, max_per_tenant=3) for _ in range(3)]
        + [create("globex", "alice", max_per_requestor=2, max_per_tenant=3) for _ in range(3)]
    )
    made = await batch(admin, items)
    created = [(r["tenant_id"], r["subject"]) for r in made if r["task_id"] is not None]
    assert created == [("acme", "alice")] * 2 + [("acme", "bob")] + [("globex", "alice")] * 2
    await counters_match(admin)


async def test_the_retrieve_interval_records_once_and_counts_the_repeats_before_T_SEC_10(
    admin: asyncpg.Connection,
) -> None:
    """Once per requestor per interval, in one batch and across batches; the next recorded
    retrieve carries the repeats since the last one (repeats_before)."""
    item = create("acme", "alice")
    await batch(admin, [item])
    await finish_batch(admin, [finish(item)])
    await admin.execute("SET mcp_tasks.audit_retrieve_interval_s = '1'")
    await batch(admin, [retrieve(item)] * 3)
    await batch(admin, [retrieve(item)])
    other = retrieve(item | {"subject": "bob"})  # someone else's: no task, no event
    assert [r["task_id"] for r in await batch(admin, [other])] == [None]
    retrieves = [e for e in await chain(admin, "acme") if e["action"] == "retrieve"]
    assert [e["detail"] for e in retrieves] == [None]
    await asyncio.sleep(1.1)
    await batch(admin, [retrieve(item)] * 2)
    retrieves = [e for e in await chain(admin, "acme") if e["action"] == "retrieve"]
    assert [json.loads(e["detail"]) if e["detail"] else None for e in retrieves] == [None, {"repeats_before": 3}]
    seen = await admin.fetchrow("SELECT repeats FROM audit_retrievals WHERE task_id = $1", item["task_id"])
    assert seen["repeats"] == 1
    # Interval 0: every retrieve is recorded, nothing is remembered.
    await admin.execute("SET mcp_tasks.audit_retrieve_interval_s = '0'")
    await batch(admin, [retrieve(item)] * 2)
    assert len([e for e in await chain(admin, "acme") if e["action"] == "retrieve"]) == 4
    assert await chain_problems(admin) == []


async def test_the_app_role_appends_only_to_its_transactions_tenant_T_SEC_10(admin: asyncpg.Connection) -> None:
    """audit_append_events (and audit_append through it): the app role appends only to the tenant
    its transaction names, every event of a call included; the runner role to any tenant's."""
    event = "ROW('deny', 'forged', '', '', '', NULL, NULL, NULL, NULL)::audit_event_item"
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_role(admin, APP, f"SELECT audit_append_events(ARRAY['acme'], ARRAY[{event}])", tenant="globex")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_role(admin, APP, f"SELECT audit_append_events(ARRAY['acme', 'globex'], ARRAY[{event}, {event}])",
                      tenant="acme")  # fmt: skip
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_role(admin, APP, "SELECT audit_append('acme', 'deny', 'x', '', '', '', NULL, NULL, NULL, NULL)",
                      tenant="globex")  # fmt: skip
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_role(admin, APP, "SELECT audit_retrieval_due('acme', 'x', 'alice')", tenant="acme")
    appended = await as_role(
        admin, APP, f"SELECT audit_append_events(ARRAY['acme'], ARRAY[{event}]) AS seq", tenant="acme"
    )
    assert appended[0]["seq"] == 1
    both = f"SELECT audit_append_events(ARRAY['acme', 'globex'], ARRAY[{event}, {event}]) AS seq"
    assert (await as_role(admin, RUNNER, both))[0]["seq"] == 1  # the last event's: globex's first
    assert await chain_problems(admin) == []


async def called(conn: asyncpg.Connection, sql: str, *args: Any, role: str = "mcp_tasks_record") -> dict[str, int]:
    """Run ``sql`` as ``role``; how often each audit function ran in it. (The view adds the counts
    of earlier transactions the backend has not reported yet: the difference is this one's.)"""

    async def counts() -> dict[str, int]:
        rows = await conn.fetch(
            """SELECT funcname, calls FROM pg_stat_xact_user_functions
               WHERE funcname IN ('audit_append_events', 'audit_append')"""
        )
        return {r["funcname"]: r["calls"] for r in rows}

    async with conn.transaction():
        await conn.execute("SET LOCAL track_functions = 'all'")
        before = await counts()
        await conn.execute(f"SET LOCAL ROLE {role}")
        await conn.execute(sql, *args)
        await conn.execute("RESET ROLE")
        after = await counts()
    return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}


async def test_a_finish_batch_of_many_tenants_appends_every_chain_with_one_call_T_SEC_10(
    admin: asyncpg.Connection,
) -> None:
    """A finish batch spanning tenants appends all their events by one call of audit_append_events,
    each event on its own tenant's chain, in item order after what the chain held, and every
    chain verifies."""
    await as_role(
        admin, APP, "SELECT audit_append('acme', 'deny', 'x', '', '', '', NULL, NULL, NULL, NULL)", tenant="acme"
    )
    items = ordered([create(t, s) for t in ("acme", "globex", "initech") for s in ("alice", "bob") for _ in range(3)])
    await batch(admin, items)
    calls = await called(
        admin, "SELECT * FROM task_finish($1::jsonb)", json.dumps([finish(i) for i in items]), role=RUNNER
    )
    assert calls == {"audit_append_events": 1}
    finished = await admin.fetch("SELECT task_id FROM tasks WHERE status = 'completed'")
    assert {r["task_id"] for r in finished} == {i["task_id"] for i in items}
    for tenant, before in (("acme", 1), ("globex", 0), ("initech", 0)):
        mine = [i["task_id"] for i in items if i["tenant_id"] == tenant]
        events = await chain(admin, tenant)
        assert [e["seq"] for e in events] == list(range(1, before + 2 * len(mine) + 1))
        assert [e["action"] for e in events[before + len(mine) :]] == ["complete"] * len(mine)
        assert [e["task_id"] for e in events[before + len(mine) :]] == mine
        assert all(a["at"] <= b["at"] for a, b in itertools.pairwise(events))
        head = await admin.fetchrow("SELECT seq, hash, at FROM audit_heads WHERE tenant_id = $1", tenant)
        last = await admin.fetchrow(
            "SELECT seq, hash, at FROM audit_events WHERE tenant_id = $1 ORDER BY seq DESC LIMIT 1", tenant
        )
        assert tuple(head) == tuple(last)
    await counters_match(admin)
    assert await chain_problems(admin) == []


def events_sql(actions: list[tuple[str, str]], first: int = 0, numbers: list[int] | None = None) -> str:
    """An audit_event_item[] literal of (action, subject) pairs, each numbered (its task, request
    and detail) by ``numbers``, else from ``first`` on."""
    numbers = numbers or list(range(first, first + len(actions)))
    rows = [
        f"ROW('{action}', 'ok', '{subject}', 'c', 'i', 't{n}', 'r{n}', NULL, '{{\"n\": {n}}}')::audit_event_item"
        for n, (action, subject) in zip(numbers, actions, strict=True)
    ]
    return f"ARRAY[{', '.join(rows)}]::audit_event_item[]"


async def test_one_call_for_many_tenants_appends_as_one_call_per_tenant_would_T_SEC_10(
    admin: asyncpg.Connection,
) -> None:
    """audit_append_events is the one chain step: a call for many tenants leaves each chain exactly
    as one call per tenant, in "C" order, leaves the same events on another set of tenants (new
    heads and old, names whose "C" order differs from a locale's); an event without its tenant,
    and tenants and events that do not pair up, are refused whole."""
    pairs = [("Zeta", "X-Zeta"), ("alpha", "X-alpha"), ("a-b", "X-a-b"), ("ab", "X-ab")]
    for ours, theirs in pairs[:2]:  # two of each set have a chain already
        for tenant in (ours, theirs):
            await as_role(admin, RUNNER, f"SELECT audit_append_events(ARRAY[$1], {events_sql([('deny', 'old')])})",
                          tenant)  # fmt: skip
    actions = [("complete", f"s{n % 3}") for n in range(12)]
    tenants = [pairs[n % 4][0] for n in range(12)]
    assert await called(
        admin, f"SELECT audit_append_events($1::text[], {events_sql(actions)})", tenants, role=RUNNER
    ) == {"audit_append_events": 1}
    for ours, theirs in sorted(pairs, key=lambda p: p[1].encode()):  # the per-tenant calls, in "C" order
        mine = [n for n, t in enumerate(tenants) if t == ours]
        mine_sql = events_sql([actions[n] for n in mine], numbers=mine)
        await as_role(admin, RUNNER, f"SELECT audit_append_events(array_fill($1::text, ARRAY[{len(mine)}]), {mine_sql})",
                      theirs)  # fmt: skip
    fields = "seq, action, outcome, subject, client_id, issuer, request_id, detail::text AS detail"
    for ours, theirs in pairs:
        got = await admin.fetch(f"SELECT {fields} FROM audit_events WHERE tenant_id = $1 ORDER BY seq", ours)
        want = await admin.fetch(f"SELECT {fields} FROM audit_events WHERE tenant_id = $1 ORDER BY seq", theirs)
        assert [tuple(r) for r in got] == [tuple(r) for r in want]
        assert len(got) == (4 if ours in ("Zeta", "alpha") else 3)
        head = await admin.fetchrow("SELECT seq, hash, at FROM audit_heads WHERE tenant_id = $1", ours)
        last = await admin.fetchrow(
            "SELECT seq, hash, at FROM audit_events WHERE tenant_id = $1 ORDER BY seq DESC LIMIT 1", ours
        )
        assert tuple(head) == tuple(last)
    for tenants_sql, events in (
        ("ARRAY['ab', NULL]", events_sql([("deny", "a")] * 2)),
        ("ARRAY['ab']", events_sql([("deny", "a")] * 2)),
    ):
        with pytest.raises(asyncpg.InvalidParameterValueError):
            await as_role(admin, RUNNER, f"SELECT audit_append_events({tenants_sql}, {events})")
    assert await admin.fetchval("SELECT seq FROM audit_heads WHERE tenant_id = 'ab'") == 3
    assert await chain_problems(admin) == []


async def test_a_finish_batch_dates_its_events_the_same_under_any_date_style_T_SEC_10(
    admin: asyncpg.Connection,
) -> None:
    """the heads' times are read as timestamps, not through a
    row's text, which the session's DateStyle writes with a zone abbreviation that reads back at
    another offset (CST: China, read as US Central). Every event is dated now, never ahead."""
    items = ordered([create(t, "alice") for t in ("acme", "globex") for _ in range(2)])
    await batch(admin, items)
    for round_ in range(2):  # the second batch starts from the times the first one wrote
        if round_:
            again = ordered([create(t, "alice") for t in ("acme", "globex") for _ in range(2)])
            await batch(admin, again)
            items = again
        async with admin.transaction():
            await admin.execute("SET LOCAL DateStyle = 'Postgres'")
            await admin.execute("SET LOCAL TimeZone = 'Asia/Shanghai'")
            await admin.execute(f"SET LOCAL ROLE {RUNNER}")
            await admin.fetch("SELECT * FROM task_finish($1::jsonb)", json.dumps([finish(i) for i in items]))
    ahead = await admin.fetchval("SELECT count(*) FROM audit_events WHERE at > clock_timestamp()")
    assert ahead == 0
    for tenant in ("acme", "globex"):
        head = await admin.fetchrow("SELECT seq, at FROM audit_heads WHERE tenant_id = $1", tenant)
        last = await admin.fetchrow(
            "SELECT seq, at FROM audit_events WHERE tenant_id = $1 ORDER BY seq DESC LIMIT 1", tenant
        )
        assert tuple(head) == tuple(last)
    assert await chain_problems(admin) == []


async def test_a_tasks_retrieval_rows_go_with_it_when_the_sweeper_deletes_it_T_SEC_10(
    admin: asyncpg.Connection,
) -> None:
    """no foreign key ties audit_retrievals to tasks any more; the statement
    trigger on tasks deletes, as mcp_tasks_record, the rows of every task a statement deleted
    (here the sweeper's own batch, as the runner role), and only theirs."""
    doomed = [create("acme", "alice"), create("acme", "bob"), create("globex", "alice")]
    kept = create("acme", "alice")
    await batch(admin, ordered([*doomed, kept]))
    await finish_batch(admin, [finish(i) for i in ordered([*doomed, kept])])
    await batch(admin, ordered([retrieve(i) for i in [*doomed, kept]]))
    assert await admin.fetchval("SELECT count(*) FROM audit_retrievals") == 4
    ids = [i["task_id"] for i in doomed]
    await admin.execute("UPDATE tasks SET expires_at = clock_timestamp() - interval '1 s' WHERE task_id = ANY($1)", ids)
    async with admin.transaction():
        await admin.execute(f"SET LOCAL ROLE {RUNNER}")
        status = await admin.execute(Q["delete_expired_tasks"], 100)
    assert status == "DELETE 3"
    rows = await admin.fetch("SELECT task_id FROM audit_retrievals")
    assert [r["task_id"] for r in rows] == [kept["task_id"]]
    # The app and runner roles still cannot touch the rows themselves.
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_role(admin, RUNNER, "DELETE FROM audit_retrievals")
    for role in (APP, RUNNER):
        assert not await admin.fetchval(
            "SELECT has_function_privilege($1, 'tasks_forget_retrievals()', 'EXECUTE')", role
        )
    # A later retrieval of the kept task is only counted: its row still decides.
    await batch(admin, [retrieve(kept)])
    assert await admin.fetchval("SELECT repeats FROM audit_retrievals WHERE task_id = $1", kept["task_id"]) == 1
    assert await chain_problems(admin) == []


@pytest.mark.parametrize("held_at", [0, 1])
async def test_a_finish_batch_locks_its_rows_in_item_order_with_one_statement(
    database_url: str, admin: asyncpg.Connection, held_at: int
) -> None:
    """task_finish locks every row of the batch by one statement, still in the
    items' order (the order every writer locks rows in, so batches and cancels never wait on each
    other in a cycle), whatever the rows' key or physical order: the items are named in reverse key
    order. Another transaction holds one item's row: while the batch waits on it, the rows of the
    items before it are locked and those after it are not."""
    tasks = ordered([create("acme", "alice") for _ in range(3)])
    await batch(admin, tasks)
    items = list(reversed(tasks))
    holder = await asyncpg.connect(database_url)
    finisher = await asyncpg.connect(database_url)
    waiting: asyncio.Task[list[asyncpg.Record]] | None = None
    try:
        hold = holder.transaction()
        await hold.start()
        lock = "SELECT 1 FROM tasks WHERE tenant_id = 'acme' AND task_id = $1 FOR NO KEY UPDATE"
        await holder.execute(lock, items[held_at]["task_id"])
        waiting = asyncio.create_task(finish_batch(finisher, [finish(i) for i in items]))
        for _ in range(500):  # until the batch waits on the held row
            await asyncio.sleep(0.01)
            if holder.get_server_pid() in await admin.fetchval(
                "SELECT pg_blocking_pids($1)", finisher.get_server_pid()
            ):
                break
        else:
            pytest.fail("the finish batch never waited on the held row")
        async with admin.transaction():
            for place, item in enumerate(items):
                if place == held_at:
                    continue
                if place < held_at:  # locked before the batch met the held row
                    with pytest.raises(asyncpg.LockNotAvailableError):
                        async with admin.transaction():
                            await admin.fetchval(lock + " NOWAIT", item["task_id"])
                else:  # not locked yet
                    assert await admin.fetchval(lock + " NOWAIT", item["task_id"]) == 1
        await hold.rollback()
        done = await asyncio.wait_for(waiting, 10)
        assert [r["task_id"] for r in done] == [i["task_id"] for i in items]
        assert all(r["status"] == "completed" for r in done)
    finally:
        if waiting is not None and not waiting.done():
            waiting.cancel()
            with contextlib.suppress(BaseException):
                await waiting
        await holder.close()
        await finisher.close()


async def test_the_queue_gauges_count_the_queued_and_the_running_tasks_per_tool_not_finished_ones(
    admin: asyncpg.Connection,
) -> None:
    """queue_by_tool (the queue gauges, once per maintenance pass, as the runner role) counts per
    tool the tasks waiting for a runner and those running, whichever tenant or subject holds them;
    finished tasks, stored beside them by the thousand, count in neither. That it reads them from
    the partial indexes of exactly those rows is a plan: `make plans` (bench/plans.py) checks it."""
    queued = [create("acme", "alice", tool="slow", lease_owner=None, lease_ms=None) for _ in range(3)]
    running = [create("acme", "bob", tool="slow") for _ in range(2)] + [create("globex", "carol")]
    done = [create("acme", "alice") for _ in range(3)]
    await batch(admin, ordered(queued + running + done))
    await finish_batch(admin, [finish(i) for i in ordered(done)])
    await store_finished(admin, 1_000)
    counts = {r["tool"]: (r["queued"], r["running"]) for r in await as_role(admin, RUNNER, Q["queue_by_tool"])}
    assert counts == {"slow": (3, 2), "echo": (0, 1)}


async def test_a_finish_batch_finds_its_rows_by_key_with_a_plan_made_on_a_young_table(
    database_url: str, admin: asyncpg.Connection
) -> None:
    """a connection's plans of task_finish are made once and kept, maybe
    while the table holds a few rows and has no statistics (a new deployment; a server whose
    autovacuum is off). Joined with the items, the table was then read by a hash join over a scan
    of every row, for every batch after, however many tasks it came to hold. The batch's rows are
    found by primary key instead: no sequential scan of tasks, with the generic plan made young."""
    runner = await asyncpg.connect(database_url)
    try:
        await runner.execute("SET plan_cache_mode = force_generic_plan")
        young = ordered([create("acme", "alice") for _ in range(2)])
        await batch(admin, young)
        await finish_batch(runner, [finish(young[0])])  # the plans are made now, on two rows
        await store_finished(admin, 5_000)
        async with runner.transaction():
            await runner.execute(f"SET LOCAL ROLE {RUNNER}")
            done = await runner.fetch("SELECT * FROM task_finish($1::jsonb)", json.dumps([finish(young[1])]))
            await runner.execute("RESET ROLE")
            scans = await runner.fetchrow(
                "SELECT seq_scan, idx_scan FROM pg_stat_xact_user_tables WHERE relname = 'tasks'"
            )
        assert [r["status"] for r in done] == ["completed"]
        assert scans["seq_scan"] == 0
        assert scans["idx_scan"] >= 2  # locked, then updated, by key
    finally:
        await runner.close()
