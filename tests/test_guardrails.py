"""Guardrails: concurrency caps, rate limits, metrics (T-SEC-6, T-SEC-7, T-SEC-9, T-SEC-11)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from service.observability import metrics
from tests.conftest import RunningServer, make_settings, run_issuer, serve
from tests.issuer import LocalIssuer
from tests.rpc import ACCEPT_BOTH, RpcSession
from tests.test_durability import mcp_tasks

INIT = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
}


async def session(http: httpx.AsyncClient, url: str, token: str | None = None) -> RpcSession:
    s = RpcSession(http, url, token=token)
    await s.initialize()
    return s


# --- concurrency caps (T-SEC-7) ---------------------------------------------------------------------


async def test_requestor_cap_refuses_with_limit_and_count_and_frees_on_terminal_T_SEC_7(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with serve(make_settings(database_url, max_active_tasks_per_requestor=2)) as running:
        s = await session(http, running.url)
        first = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        await s.call_tool_as_task("hang", {})
        error = await s.error("tools/call", {"name": "hang", "arguments": {}, "task": {}})
        assert error["code"] == -32000
        assert error["data"] == {"scope": "requestor", "limit": 2, "current": 2}
        assert len((await s.result("tasks/list"))["tasks"]) == 2  # no row written for the refusal
        await s.result("tasks/cancel", {"taskId": first})  # a terminal task frees its slot at once
        assert (await s.call_tool_as_task("hang", {}))["task"]["status"] == "working"


async def test_tenant_cap_counts_every_subject_of_the_tenant(database_url: str, http: httpx.AsyncClient) -> None:
    async with run_issuer(LocalIssuer()) as issuer:
        settings = make_settings(
            database_url,
            auth="oauth",
            oauth_issuer=issuer.url,
            max_active_tasks_per_requestor=2,
            max_active_tasks_per_tenant=3,
        )
        async with serve(settings) as running:
            alice = await session(http, running.url, issuer.mint(running.url, sub="alice"))
            bob = await session(http, running.url, issuer.mint(running.url, sub="bob"))
            other = await session(http, running.url, issuer.mint(running.url, sub="carol", tenant_id="globex"))
            await alice.call_tool_as_task("hang", {})
            await alice.call_tool_as_task("hang", {})
            await bob.call_tool_as_task("hang", {})
            error = await bob.error("tools/call", {"name": "hang", "arguments": {}, "task": {}})
            assert error["data"] == {"scope": "tenant", "limit": 3, "current": 3}
            assert (await other.call_tool_as_task("hang", {}))["task"]["status"] == "working"


@pytest.mark.slow
async def test_two_processes_creating_at_once_never_overshoot_the_cap(
    database_url: str, http: httpx.AsyncClient
) -> None:
    cap = 5
    env = {"MCP_TASKS_MAX_ACTIVE_TASKS_PER_REQUESTOR": str(cap), "MCP_TASKS_RATE_LIMIT": "100000/minute"}
    async with (
        mcp_tasks("serve", database_url, **env) as (_a, url_a),
        mcp_tasks("serve", database_url, **env) as (_b, url_b),
    ):
        sessions = [await session(http, url) for url in (url_a, url_b) for _ in range(4)]

        async def create(s: RpcSession) -> dict[str, Any]:
            return await s.send("tools/call", {"name": "hang", "arguments": {}, "task": {}})

        answers = await asyncio.gather(*(create(sessions[i % len(sessions)]) for i in range(40)))
    created = [a for a in answers if "result" in a]
    refused = [a for a in answers if "error" in a]
    assert len(created) == cap
    assert len(refused) == 40 - cap
    assert all(a["error"]["code"] == -32000 for a in refused)
    db = await asyncpg.connect(database_url)
    try:
        assert await db.fetchval("SELECT count(*) FROM tasks") == cap
    finally:
        await db.close()


async def test_active_counters_follow_every_way_a_task_stops_being_active_T_SEC_7(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """The caps read per-requestor counters kept by a trigger: after creates, completions, failures,
    cancellations and expiry they equal a count of the active rows."""
    async with serve(make_settings(database_url, min_ttl_ms=100)) as running:
        s = await session(http, running.url)
        hung = [(await s.call_tool_as_task("hang", {}))["task"]["taskId"] for _ in range(3)]
        # Waiting for input, kept its ttl from then: it expires and is swept while still active.
        expiring = (await s.call_tool_as_task("confirm", {}, {"ttl": 300}))["task"]["taskId"]
        for tool, args in (("echo", {"text": "x"}), ("fail", {"message": "no"}), ("crash", {"message": "boom"})):
            done = (await s.call_tool_as_task(tool, args))["task"]["taskId"]
            await s.send("tasks/result", {"taskId": done})
        await s.result("tasks/cancel", {"taskId": hung[0]})
        db = await asyncpg.connect(database_url)
        try:
            async with asyncio.timeout(10):  # the sweeper (every 200 ms here) deletes the expired task
                while await db.fetchval("SELECT count(*) FROM tasks WHERE task_id = $1", expiring):
                    await asyncio.sleep(0.05)
            true_counts = await db.fetch(
                "SELECT tenant_id, subject, count(*) AS n FROM tasks WHERE status IN ('working', 'input_required') "
                "GROUP BY 1, 2 ORDER BY 1, 2"
            )
            counters = await db.fetch("SELECT tenant_id, subject, active AS n FROM active_tasks WHERE active > 0")
            assert [tuple(r) for r in counters] == [tuple(r) for r in true_counts] == [("local", "local", 2)]
        finally:
            await db.close()


# --- rate limits (T-SEC-6, T-SEC-11) ----------------------------------------------------------------


async def test_over_the_rate_limit_is_429_with_retry_after_and_a_json_rpc_error_T_SEC_6(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with serve(make_settings(database_url, rate_limit="4/minute")) as running:
        s = await session(http, running.url)  # initialize + initialized: 2 of 4
        assert "result" in await s.send("ping")
        assert "result" in await s.send("ping")
        r = await http.post(running.url, json=s.message("ping"), headers=s.headers())
        assert r.status_code == 429
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert r.json()["error"]["code"] == -32029


def test_the_in_process_limiter_allows_and_refuses_as_the_limits_memory_storage_does_T_SEC_6() -> None:
    """Issue 15: with memory:// the budgets are counted in the event loop (no expiry thread, no
    locks); they must answer as ``limits``' sliding-window counter on its memory storage does, keep
    the two budgets of one principal apart, and stay bounded in size."""
    import time

    from limits import parse
    from limits.storage import MemoryStorage
    from limits.strategies import SlidingWindowCounterRateLimiter

    from service.guard.ratelimit import _LocalWindows

    item = parse("5/minute")
    reference, ours = SlidingWindowCounterRateLimiter(MemoryStorage()), _LocalWindows()
    assert [reference.hit(item, "k") for _ in range(7)] == [ours.hit("principal", item, "k") for _ in range(7)]
    assert [ours.hit("principal", item, "other") for _ in range(6)] == [True] * 5 + [False]
    assert reference.test(item, "k") is ours.test("principal", item, "k") is False
    assert ours.test("not_found", item, "k") is True  # the same key in another scope: its own counter
    expected = reference.get_window_stats(item, "k").reset_time - time.time()
    assert abs(ours.reset_in("principal", item, "k") - expected) < 0.5
    bounded = _LocalWindows(max_keys=3)
    for i in range(10):
        assert bounded.hit("principal", item, f"key-{i}")
    assert len(bounded._hits) <= 3


async def test_lookups_that_find_nothing_have_a_tighter_budget_T_SEC_11(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with serve(make_settings(database_url, rate_limit_not_found="3/minute")) as running:
        s = await session(http, running.url)
        task_id = (await s.call_tool_as_task("echo", {"text": "x"}))["task"]["taskId"]
        assert (await s.result("tasks/get", {"taskId": task_id}))["taskId"] == task_id  # hits do not count
        for i in range(3):
            assert (await s.error("tasks/get", {"taskId": f"guess-{i}"}))["code"] == -32602
        r = await http.post(running.url, json=s.message("tasks/get", {"taskId": task_id}), headers=s.headers())
        assert r.status_code == 429
        assert r.json()["error"]["code"] == -32029
        assert r.json()["id"] is not None
        assert "result" in await s.send("tools/list")  # only lookups are held back


async def test_failed_authentication_is_limited_by_client_address(database_url: str, http: httpx.AsyncClient) -> None:
    async with run_issuer(LocalIssuer()) as issuer:
        settings = make_settings(
            database_url, auth="oauth", oauth_issuer=issuer.url, rate_limit_unauthenticated="2/minute"
        )
        async with serve(settings) as running:
            known = await session(http, running.url, issuer.mint(running.url, sub="alice"))  # verified once
            bad = {"Accept": ACCEPT_BOTH, "Authorization": "Bearer nope"}
            statuses = [(await http.post(running.url, json=INIT, headers=bad)).status_code for _ in range(3)]
            assert statuses == [401, 401, 429]
            # The address is over budget: a token never verified is refused before any work on it...
            fresh = {"Accept": ACCEPT_BOTH, "Authorization": f"Bearer {issuer.mint(running.url, sub='bob')}"}
            assert (await http.post(running.url, json=INIT, headers=fresh)).status_code == 429
            # ...while a token verified before costs nothing to check and is served (same address).
            assert await known.result("ping") == {}


@pytest.mark.slow
async def test_two_processes_sharing_one_redis_share_one_budget(database_url: str, http: httpx.AsyncClient) -> None:
    async with run_issuer(LocalIssuer()) as issuer:
        env = {
            "MCP_TASKS_OAUTH_ISSUER": issuer.url,
            "MCP_TASKS_RATE_LIMIT": "6/minute",
            "MCP_TASKS_RATE_LIMIT_STORAGE": "redis://127.0.0.1:6379",
        }
        async with (
            mcp_tasks("serve", database_url, **env) as (_a, url_a),
            mcp_tasks("serve", database_url, **env) as (_b, url_b),
        ):
            subject = f"budget-{secrets.token_hex(6)}"  # a fresh key: earlier runs cannot have spent it

            async def initialize(url: str) -> int:
                # Each server verifies the token against its own audience (its own URL).
                headers = {"Accept": ACCEPT_BOTH, "Authorization": f"Bearer {issuer.mint(url, sub=subject)}"}
                return (await http.post(url, json=INIT, headers=headers)).status_code

            statuses = [await initialize(url_a if i % 2 else url_b) for i in range(10)]
    assert statuses.count(200) == 6
    assert statuses.count(429) == 4


# --- metrics (T-SEC-9) ------------------------------------------------------------------------------


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


async def metrics_of(
    http: httpx.AsyncClient, server: RunningServer
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = await http.get(server.url.removesuffix("/mcp") + "/metrics")
    assert r.status_code == 200
    return scrape(r.text)


def value(m: dict[Any, float], name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
async def metered(database_url: str) -> AsyncIterator[RunningServer]:
    async with serve(make_settings(database_url, max_active_tasks_per_requestor=1)) as running:
        yield running


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_the_request_meter_hands_prometheus_client_what_inc_and_observe_would_T_SEC_9() -> None:
    """Requests are counted without prometheus-client's locks and handed over in sums: the
    exposition is the one a counter ``inc`` and a histogram ``observe`` per request would give,
    bucket for bucket (a latency on a bound goes in that bound's bucket; beyond the last, +Inf)."""
    method = f"test/{secrets.token_hex(4)}"  # a child of its own: the deltas are this test's alone
    latencies = [0.0, 0.0004, 0.001, 0.0011, 0.7, 2.5, 59.0, 61.0, 1e6]
    reference = Histogram("ref_seconds", "reference", buckets=metrics.LATENCY_BUCKETS, registry=CollectorRegistry())
    for seconds in latencies:
        metrics.request_meter.record(method, "ok", "2025-11-25", seconds)
        reference.observe(seconds)
    metrics.request_meter.record(method, "error", "2025-11-25", 0.002)
    reference.observe(0.002)
    assert _sample("mcp_tasks_request_duration_seconds_count", method=method) == 0  # not handed over yet
    metrics.request_meter.flush()
    assert _sample("mcp_tasks_requests_total", method=method, outcome="ok", wire="2025-11-25") == len(latencies)
    assert _sample("mcp_tasks_requests_total", method=method, outcome="error", wire="2025-11-25") == 1
    ref = {(s.name, s.labels.get("le")): s.value for m in reference.collect() for s in m.samples}
    for le in [*(str(float(b)) for b in metrics.LATENCY_BUCKETS), "+Inf"]:
        got = _sample("mcp_tasks_request_duration_seconds_bucket", method=method, le=le)
        assert got == ref[("ref_seconds_bucket", le)], le
    assert _sample("mcp_tasks_request_duration_seconds_count", method=method) == len(latencies) + 1
    assert _sample("mcp_tasks_request_duration_seconds_sum", method=method) == pytest.approx(
        ref[("ref_seconds_sum", None)]
    )
    metrics.request_meter.flush()  # nothing new: nothing counted twice
    assert _sample("mcp_tasks_request_duration_seconds_count", method=method) == len(latencies) + 1


def test_the_request_meter_hands_over_at_once_outside_an_event_loop_T_SEC_9() -> None:
    method = f"test/{secrets.token_hex(4)}"
    metrics.request_meter.record(method, "ok", "none", 0.02)
    assert _sample("mcp_tasks_requests_total", method=method, outcome="ok", wire="none") == 1


async def test_the_request_meter_hands_over_within_a_second_without_a_scrape_T_SEC_9() -> None:
    """Multiprocess mode's files are scraped by another process: a request's count must reach
    prometheus-client by itself, not only when this process is scraped."""
    method = f"test/{secrets.token_hex(4)}"
    metrics.request_meter.record(method, "ok", "2026-07-28", 0.01)
    for _ in range(100):  # REQUEST_FLUSH_S is 1 s; a loaded machine gets five
        if _sample("mcp_tasks_requests_total", method=method, outcome="ok", wire="2026-07-28") == 1:
            break
        await asyncio.sleep(0.05)
    assert _sample("mcp_tasks_requests_total", method=method, outcome="ok", wire="2026-07-28") == 1
    assert _sample("mcp_tasks_request_duration_seconds_sum", method=method) == pytest.approx(0.01)


async def test_metrics_move_as_tasks_run_T_SEC_9(metered: RunningServer, http: httpx.AsyncClient) -> None:
    before = await metrics_of(http, metered)
    s = await session(http, metered.url)
    task_id = (await s.call_tool_as_task("echo", {"text": "m"}))["task"]["taskId"]
    await s.result("tasks/result", {"taskId": task_id})
    await s.error("tasks/get", {"taskId": "nope"})
    hang = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
    await s.error("tools/call", {"name": "hang", "arguments": {}, "task": {}})  # over the cap of 1
    await s.result("tasks/cancel", {"taskId": hang})
    await metered.app.state.core.maintenance.observe()  # a maintenance pass refreshes the gauges
    after = await metrics_of(http, metered)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("mcp_tasks_tasks_created_total", tool="echo") == 1
    assert delta("mcp_tasks_tasks_finished_total", tool="echo", status="completed", outcome="result") == 1
    assert delta("mcp_tasks_tasks_finished_total", tool="hang", status="cancelled", outcome="cancelled") == 1
    assert delta("mcp_tasks_cap_refusals_total", scope="requestor") == 1
    assert delta("mcp_tasks_requests_total", method="tasks/get", outcome="error", wire="2025-11-25") == 1
    assert delta("mcp_tasks_requests_total", method="tasks/result", outcome="ok", wire="2025-11-25") == 1
    assert delta("mcp_tasks_request_errors_total", method="tasks/get", code="-32602", wire="2025-11-25") == 1
    assert delta("mcp_tasks_request_duration_seconds_count", method="tools/call") == 3
    assert delta("mcp_tasks_task_run_seconds_count", tool="echo") == 1
    assert value(after, "mcp_tasks_runner_slots") > 0
    assert ("mcp_tasks_tasks_active", (("status", "working"),)) in after
    assert value(after, "mcp_tasks_db_pool_connections", pool="app", state="idle") >= 0
    names = {name for name, _ in after}
    assert all(n.startswith(("mcp_tasks_", "python_", "process_")) for n in names)
    assert not any(label == "task_id" or label == "subject" for _, labels in after for label, _v in labels)


async def test_the_active_gauge_splits_working_and_input_required_T_SEC_9(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Read from the counters and the input_required index (migration 0005), as a count would say."""
    async with serve(make_settings(database_url)) as running:
        s = RpcSession(http, running.url)
        await s.initialize(capabilities={"elicitation": {}})
        await s.call_tool_as_task("hang", {})
        await s.call_tool_as_task("hang", {})
        asking = (await s.call_tool_as_task("confirm", {"prompt": "go?"}))["task"]["taskId"]
        async with asyncio.timeout(15):
            while (await s.result("tasks/get", {"taskId": asking}))["status"] != "input_required":
                await asyncio.sleep(0.05)
        await running.app.state.core.maintenance.observe()  # a maintenance pass, now
        m = await metrics_of(http, running)
        assert value(m, "mcp_tasks_tasks_active", status="working") == 2
        assert value(m, "mcp_tasks_tasks_active", status="input_required") == 1


async def test_auth_failures_are_counted_by_reason(database_url: str, http: httpx.AsyncClient) -> None:
    issuer = LocalIssuer()
    async with run_issuer(issuer), serve(make_settings(database_url, auth="oauth", oauth_issuer=issuer.url)) as running:
        before = await metrics_of(http, running)
        await http.post(running.url, json=INIT, headers={"Accept": ACCEPT_BOTH})
        expired = issuer.mint(running.url, exp=1, iat=0, nbf=None)
        await http.post(running.url, json=INIT, headers={"Accept": ACCEPT_BOTH, "Authorization": f"Bearer {expired}"})
        after = await metrics_of(http, running)
    for reason in ("no_token", "expired"):
        moved = value(after, "mcp_tasks_auth_failures_total", reason=reason)
        assert moved - value(before, "mcp_tasks_auth_failures_total", reason=reason) == 1, reason


@pytest.mark.slow
async def test_metrics_of_several_processes_add_up_in_multiprocess_mode(
    database_url: str, http: httpx.AsyncClient, tmp_path: Any
) -> None:
    shared = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    async with (
        mcp_tasks("worker", database_url, **shared),
        mcp_tasks("serve", database_url, MCP_TASKS_RUNNER_CONCURRENCY="0", **shared) as (_proc, url),
    ):
        s = await session(http, url)
        for i in range(3):
            task_id = (await s.call_tool_as_task("echo", {"text": str(i)}))["task"]["taskId"]
            await s.result("tasks/result", {"taskId": task_id})  # finished by the worker process
        r = await http.get(url.removesuffix("/mcp") + "/metrics")
    m = scrape(r.text)
    assert value(m, "mcp_tasks_tasks_created_total", tool="echo") == 3  # counted by the front end
    assert (
        value(m, "mcp_tasks_tasks_finished_total", tool="echo", status="completed", outcome="result") == 3
    )  # by the worker


async def test_counters_sum_a_statement_that_changes_many_tasks_of_many_requestors(database_url: str) -> None:
    """One UPDATE or DELETE over several requestors' tasks (the sweeper deletes in batches) changes
    each requestor's counter by its own tasks only; a change between active states changes nothing."""
    db = await asyncpg.connect(database_url, server_settings={"role": "mcp_tasks_runner"})
    try:
        await db.execute(
            """INSERT INTO tasks (tenant_id, task_id, subject, wire, tool, arguments, ttl_ms, poll_interval_ms,
                                  expires_at)
               SELECT 'acme', 't' || i, 'user-' || (i % 3), '2025-11-25', 'echo', '{}', 60000, 100,
                      now() - interval '1 second'
               FROM generate_series(1, 9) AS i"""  # expired: the service's roles delete only those
        )
        counts = "SELECT subject, active FROM active_tasks WHERE tenant_id = 'acme' ORDER BY subject"
        assert [tuple(r) for r in await db.fetch(counts)] == [("user-0", 3), ("user-1", 3), ("user-2", 3)]
        await db.execute(
            "UPDATE tasks SET status = 'cancelled' WHERE subject IN ('user-0', 'user-1') AND task_id <> 't1'"
        )
        await db.execute("UPDATE tasks SET status = 'input_required' WHERE subject = 'user-2'")  # active to active
        assert [tuple(r) for r in await db.fetch(counts)] == [("user-0", 0), ("user-1", 1), ("user-2", 3)]
        await db.execute("DELETE FROM tasks WHERE tenant_id = 'acme'")
        assert [tuple(r) for r in await db.fetch(counts)] == [("user-0", 0), ("user-1", 0), ("user-2", 0)]
    finally:
        await db.close()


@pytest.mark.parametrize(("mode", "status"), [("open", 200), ("closed", 503)])
async def test_unreachable_rate_limit_storage_fails_open_or_closed_as_set(
    database_url: str, http: httpx.AsyncClient, mode: str, status: int
) -> None:
    """Issue 13, point 4: Redis down → requests pass (open, the default) or get 503 + Retry-After
    (closed), and it is counted either way."""
    before = REGISTRY.get_sample_value("mcp_tasks_rate_limit_storage_errors_total") or 0.0
    settings = make_settings(database_url, rate_limit_storage="redis://127.0.0.1:1", rate_limit_fail=mode)
    async with serve(settings) as running:
        r = await http.post(running.url, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
            headers={"Accept": "application/json, text/event-stream"})  # fmt: skip
    assert r.status_code == status, r.text
    if status == 503:
        assert r.headers["retry-after"]
        assert r.json()["error"]["code"] == -32001
    assert (REGISTRY.get_sample_value("mcp_tasks_rate_limit_storage_errors_total") or 0.0) > before


async def test_rate_limit_storage_back_is_logged_once_on_the_first_request_it_allows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 13, point 4 ("one log line on loss and one on recovery"): the recovery line came only
    when a request was over its limit, so an outage followed by ordinary traffic never logged its
    end (found by tests/faults/test_redis_killed.py)."""
    from service.domain.principal import LOCAL_PRINCIPAL
    from service.guard.ratelimit import RateLimiter
    from tests.faults.harness import Redis, free_port, require

    redis = Redis(free_port(), require("redis-server"))
    limiter = RateLimiter(make_settings("", rate_limit_storage=redis.url, rate_limit_fail="open"))
    with caplog.at_level("WARNING", logger="service.guard.ratelimit"):
        assert await limiter.request(LOCAL_PRINCIPAL) is None  # nothing listens: fails open
        await redis.start()
        try:
            assert await limiter.request(LOCAL_PRINCIPAL) is None
            assert await limiter.request(LOCAL_PRINCIPAL) is None
        finally:
            await redis.kill()
    lines = [r.getMessage() for r in caplog.records if r.name == "service.guard.ratelimit"]
    assert [line.split(" (")[0] for line in lines] == [
        "rate limit storage unreachable",
        "rate limit storage reachable again",
    ], lines
