"""The audit trail (T-SEC-10, T-SEC-11): one hash-chained event per change, written with the change,
append-only, and checkable with `mcp-tasks audit verify` / `export`. Real server, real PostgreSQL;
rows are read as the superuser (who bypasses row-level security). Verification and export run the
command's own code (AuditLog) in this process; a few tests run the command itself, for what only
its process shows: exit codes, its output lines, one-line errors without a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from service.store.db import Database
from service.tasks.audit import AuditLog
from tests.conftest import RunningServer, free_port, make_settings, run_issuer, serve
from tests.issuer import LocalIssuer
from tests.rpc import RpcSession

ROOT = Path(__file__).resolve().parent.parent
GENESIS = "00" * 32
FIELDS = {
    "tenant_id", "seq", "at", "action", "outcome", "subject", "client_id", "issuer",
    "task_id", "request_id", "client_address", "detail", "prev_hash", "hash",
}  # fmt: skip
APP_ROLE, RUNNER_ROLE = "mcp_tasks_app", "mcp_tasks_runner"
# Owns audit_append: the only role that writes events (migration 0005).
RECORD_ROLE = "mcp_tasks_record"
TRIGGER = "audit_events_no_update_delete"


# --- helpers ----------------------------------------------------------------------------------


async def audit_rows(database_url: str, tenant: str | None = None) -> list[dict[str, Any]]:
    """Every audit event (of one tenant, or all), in chain order, as plain dicts."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            """SELECT tenant_id, seq, at, action, outcome, subject, client_id, issuer, task_id, request_id,
                      client_address, detail::text AS detail,
                      encode(prev_hash, 'hex') AS prev_hash, encode(hash, 'hex') AS hash
               FROM audit_events WHERE $1::text IS NULL OR tenant_id = $1 ORDER BY tenant_id, seq""",
            tenant,
        )
    finally:
        await conn.close()
    out = []
    for row in rows:
        event = dict(row)
        event["detail"] = json.loads(event["detail"]) if event["detail"] is not None else None
        out.append(event)
    return out


async def wait_for_event(
    database_url: str, matches: Callable[[dict[str, Any]], bool], timeout: float = 15
) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            for event in await audit_rows(database_url):
                if matches(event):
                    return event
            await asyncio.sleep(0.05)


def only(events: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    found = [e for e in events if all(e[k] == v for k, v in fields.items())]
    assert len(found) == 1, (fields, events)
    return found[0]


def assert_linked_without_gaps(events: list[dict[str, Any]]) -> None:
    """Per tenant: seq 1, 2, 3 ... and every prev_hash is the previous row's hash."""
    tenants = {e["tenant_id"] for e in events}
    for tenant in tenants:
        chain = [e for e in events if e["tenant_id"] == tenant]
        assert [e["seq"] for e in chain] == list(range(1, len(chain) + 1)), tenant
        assert [e["prev_hash"] for e in chain] == [GENESIS] + [e["hash"] for e in chain[:-1]], tenant


async def post(s: RpcSession, method: str, params: dict[str, Any], request_id: str) -> tuple[httpx.Response, Any]:
    """One JSON-answered request with our X-Request-Id; the HTTP response and its JSON body."""
    r = await s.http.post(s.url, json=s.message(method, params), headers=s.headers(**{"X-Request-Id": request_id}))
    return r, (r.json() if r.content else None)


async def wait_status(s: RpcSession, task_id: str, *statuses: str, timeout: float = 15) -> None:
    async with asyncio.timeout(timeout):
        while (await s.result("tasks/get", {"taskId": task_id}))["status"] not in statuses:
            await asyncio.sleep(0.05)


async def mcp_tasks_audit(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`mcp-tasks audit ARGS` as its own process against the test database."""
    env = {**os.environ, "MCP_TASKS_DATABASE_URL": database_url, "MCP_TASKS_LOG_LEVEL": "WARNING"}
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "service", "audit", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


def broken(stdout: str) -> set[tuple[str, int]]:
    """(tenant, seq) named by each BROKEN line of `audit verify`."""
    return {(t, int(n)) for t, n in re.findall(r"^BROKEN\b.*?tenant=(\S+)\s+seq=(\d+)", stdout, re.M)}


@contextlib.asynccontextmanager
async def audit_log(database_url: str) -> AsyncIterator[AuditLog]:
    """The audit code `mcp-tasks audit` runs, on the pool it opens (the runner role), in this process."""
    db = Database(database_url, pool_size=2, role=RUNNER_ROLE)
    await db.open()
    try:
        yield AuditLog(db)
    finally:
        await db.close()


async def verified(database_url: str, tenant: str | None = None) -> set[tuple[str, int]]:
    """(tenant, seq) of every break `mcp-tasks audit verify [--tenant T]` names in a BROKEN line
    (the command exits 1 when there is any, 0 when there is none: its own tests show it)."""
    async with audit_log(database_url) as audit:
        return {(p.tenant_id, p.seq) for p in await audit.verify(tenant)}


async def exported(database_url: str, tenant: str | None = None, since: str | None = None) -> list[dict[str, Any]]:
    """The events `mcp-tasks audit export [--tenant T] [--since S]` writes, one per JSON line."""
    after = datetime.fromisoformat(since) if since is not None else None
    async with audit_log(database_url) as audit:
        return [json.loads(json.dumps(event)) async for event in audit.export(tenant, after)]


@contextlib.asynccontextmanager
async def superuser(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def tamper(database_url: str, *statements: str) -> None:
    """What an attacker with the superuser's password can do: switch the guard off, edit, switch it on."""
    async with superuser(database_url) as conn:
        await conn.execute(f"ALTER TABLE audit_events DISABLE TRIGGER {TRIGGER}")
        try:
            for sql in statements:
                await conn.execute(sql)
        finally:
            await conn.execute(f"ALTER TABLE audit_events ENABLE TRIGGER {TRIGGER}")


@pytest.fixture
async def s(server: RunningServer, http: httpx.AsyncClient) -> RpcSession:
    session = RpcSession(http, server.url)
    await session.initialize()
    return session


@contextlib.asynccontextmanager
async def hosted(database_url: str) -> AsyncIterator[tuple[LocalIssuer, RunningServer]]:
    async with run_issuer(LocalIssuer()) as issuer:
        settings = make_settings(database_url, auth="oauth", oauth_issuer=issuer.url, oauth_http_timeout_s=1.0)
        async with serve(settings) as running:
            yield issuer, running


@pytest.fixture
async def chain_of_four(s: RpcSession, server: RunningServer) -> str:
    """Tenant local's chain: 1 create, 2 complete, 3 retrieve, 4 deny (not_found). Returns the database URL."""
    task_id = (await s.call_tool_as_task("echo", {"text": "audited"}))["task"]["taskId"]
    await wait_status(s, task_id, "completed")
    await s.result("tasks/result", {"taskId": task_id})
    await s.error("tasks/get", {"taskId": "no-such-task"})
    database_url = server.settings.database_url
    assert database_url is not None
    events = await audit_rows(database_url, "local")
    assert [e["action"] for e in events] == ["create", "complete", "retrieve", "deny"]
    return database_url


# --- 1. one event per action, with who, what and from where ------------------------------------


async def test_creating_a_task_records_who_created_it_from_where_T_SEC_10(s: RpcSession, server: RunningServer) -> None:
    r, body = await post(
        s, "tools/call", {"name": "echo", "arguments": {"text": "hi"}, "task": {"ttl": 60_000}}, "req-create"
    )
    task_id = body["result"]["task"]["taskId"]
    assert r.headers["x-request-id"] == "req-create"
    [event] = [e for e in await audit_rows(server.settings.database_url or "") if e["action"] == "create"]
    assert event["tenant_id"] == "local"
    assert event["seq"] == 1
    assert event["prev_hash"] == GENESIS
    assert event["outcome"] == "working"
    assert (event["subject"], event["client_id"], event["issuer"]) == ("local", "local", "local")
    assert event["task_id"] == task_id
    assert event["request_id"] == "req-create"
    assert event["client_address"] == "127.0.0.1"
    assert event["detail"] == {"tool": "echo", "ttl_ms": 60_000, "wire": "2025-11-25"}


async def test_a_finished_task_records_complete_with_its_outcome_T_SEC_10(s: RpcSession, server: RunningServer) -> None:
    ok = (await s.call_tool_as_task("echo", {"text": "fine"}))["task"]["taskId"]
    bad = (await s.call_tool_as_task("fail", {"message": "broken"}))["task"]["taskId"]
    await wait_status(s, ok, "completed")
    await wait_status(s, bad, "failed")
    events = await audit_rows(server.settings.database_url or "", "local")
    completed = only(events, action="complete", task_id=ok)
    failed = only(events, action="complete", task_id=bad)
    assert completed["outcome"] == "completed"
    assert completed["detail"] == {"kind": "result"}
    # One stored outcome for both wires: a tool error is a completed call whose result says so.
    assert failed["outcome"] == "completed"
    assert failed["detail"] == {"kind": "tool_error"}
    for event in (completed, failed):
        # Attributed to the task's owner; no request made this change, so no request id or address.
        assert (event["subject"], event["client_id"], event["issuer"]) == ("local", "local", "local")
        assert event["request_id"] is None
        assert event["client_address"] is None
        assert event["seq"] > only(events, action="create", task_id=event["task_id"])["seq"]
    assert_linked_without_gaps(events)


async def test_handing_out_a_finished_result_records_retrieve_T_SEC_10(s: RpcSession, server: RunningServer) -> None:
    finished = (await s.call_tool_as_task("echo", {"text": "x"}))["task"]["taskId"]
    await wait_status(s, finished, "completed")
    r, body = await post(s, "tasks/result", {"taskId": finished}, "req-retrieve")
    assert body["result"]["content"] == [{"type": "text", "text": "x"}]
    # The blocking path: tasks/result on a working task streams, and records the retrieval at the end.
    running = (await s.call_tool_as_task("sleep", {"seconds": 0.3}))["task"]["taskId"]
    assert "result" in await s.send("tasks/result", {"taskId": running})
    events = await audit_rows(server.settings.database_url or "", "local")
    at_once = only(events, action="retrieve", task_id=finished)
    assert at_once["outcome"] == "completed"
    assert at_once["request_id"] == r.headers["x-request-id"] == "req-retrieve"
    assert at_once["client_address"] == "127.0.0.1"
    assert at_once["subject"] == "local"
    streamed = only(events, action="retrieve", task_id=running)
    assert streamed["outcome"] == "completed"
    assert streamed["seq"] > only(events, action="complete", task_id=running)["seq"]
    # tasks/get is a status read, not a retrieval of the result.
    assert len([e for e in events if e["action"] == "retrieve"]) == 2


async def test_cancelling_records_cancel_and_a_refused_cancel_too_T_SEC_10(
    s: RpcSession, server: RunningServer
) -> None:
    task_id = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
    _, body = await post(s, "tasks/cancel", {"taskId": task_id}, "req-cancel")
    assert body["result"]["status"] == "cancelled"
    _, again = await post(s, "tasks/cancel", {"taskId": task_id}, "req-cancel-again")
    assert again["error"]["code"] == -32602
    events = await audit_rows(server.settings.database_url or "", "local")
    cancels = [e for e in events if e["action"] == "cancel"]
    assert [(e["outcome"], e["request_id"], e["task_id"]) for e in cancels] == [
        ("cancelled", "req-cancel", task_id),
        ("refused:cancelled", "req-cancel-again", task_id),
    ]
    assert all(e["subject"] == "local" and e["client_address"] == "127.0.0.1" for e in cancels)
    assert not [e for e in events if e["action"] == "complete"]  # a cancelled task is not also "completed"
    assert_linked_without_gaps(events)


async def test_answering_an_elicitation_records_input_T_SEC_10(s: RpcSession, server: RunningServer) -> None:
    task_id = (await s.call_tool_as_task("confirm", {"prompt": "Ship it?"}))["task"]["taskId"]
    await wait_status(s, task_id, "input_required")
    replies: list[httpx.Response] = []
    final: dict[str, Any] = {}
    async for msg in s.stream("tasks/result", {"taskId": task_id}):
        if msg.get("method") == "elicitation/create":
            reply = {"jsonrpc": "2.0", "id": msg["id"], "result": {"action": "accept", "content": {"ok": True}}}
            replies.append(await s.http.post(s.url, json=reply, headers=s.headers(**{"X-Request-Id": "req-answer"})))
        final = msg
    assert [r.status_code for r in replies] == [202]
    assert final["result"]["content"][0]["text"] == "answer: ok=True"
    events = await audit_rows(server.settings.database_url or "", "local")
    answered = only(events, action="input")
    assert answered["outcome"] == "accept"
    assert answered["task_id"] == task_id
    assert answered["request_id"] == replies[0].headers["x-request-id"] == "req-answer"
    assert answered["client_address"] == "127.0.0.1"
    assert answered["subject"] == "local"
    assert [e["action"] for e in events] == ["create", "input", "complete", "retrieve"]
    assert_linked_without_gaps(events)


async def test_an_expired_task_records_expire_T_SEC_10(database_url: str, http: httpx.AsyncClient) -> None:
    settings = make_settings(database_url, min_ttl_ms=200, default_ttl_ms=1_000, sweep_interval_ms=100)
    async with serve(settings) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        # Waiting for input, a task is kept its ttl from its last change (a working one never expires).
        task_id = (await s.call_tool_as_task("confirm", {}, {"ttl": 300}))["task"]["taskId"]
        expired = await wait_for_event(database_url, lambda e: e["action"] == "expire" and e["task_id"] == task_id)
    assert expired["outcome"] == "input_required"  # the status it had when it was deleted
    assert expired["tenant_id"] == "local"
    assert expired["subject"] == "local"
    assert expired["client_id"] == "local"
    assert expired["request_id"] is None
    assert expired["client_address"] is None
    events = await audit_rows(database_url, "local")
    assert only(events, action="create", task_id=task_id)["detail"]["ttl_ms"] == 300
    assert not [e for e in events if e["action"] == "complete"]  # deleted, not finished
    assert_linked_without_gaps(events)


async def test_a_lookup_of_an_unknown_task_records_a_not_found_denial_T_SEC_11(
    s: RpcSession, server: RunningServer
) -> None:
    r, body = await post(s, "tasks/get", {"taskId": "guessed-id-1"}, "req-guess-1")
    assert body["error"]["code"] == -32602
    _, body = await post(s, "tasks/cancel", {"taskId": "guessed-id-2"}, "req-guess-2")
    assert body["error"]["code"] == -32602
    _, body = await post(s, "tasks/result", {"taskId": "guessed-id-3"}, "req-guess-3")
    assert body["error"]["code"] == -32602
    events = await audit_rows(server.settings.database_url or "", "local")
    assert [(e["seq"], e["action"], e["outcome"], e["task_id"], e["request_id"]) for e in events] == [
        (1, "deny", "not_found", "guessed-id-1", "req-guess-1"),
        (2, "deny", "not_found", "guessed-id-2", "req-guess-2"),
        (3, "deny", "not_found", "guessed-id-3", "req-guess-3"),
    ]
    assert all(e["subject"] == "local" and e["client_address"] == "127.0.0.1" for e in events)
    assert r.headers["x-request-id"] == "req-guess-1"


async def test_too_many_failed_lookups_records_a_rate_limited_denial_T_SEC_11(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with serve(make_settings(database_url, rate_limit_not_found="2/minute")) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        for n in range(2):
            await s.error("tasks/get", {"taskId": f"guess-{n}"})
        r, _ = await post(s, "tasks/get", {"taskId": "guess-2"}, "req-limited")
        assert r.status_code == 429
    events = await audit_rows(database_url, "local")
    assert [(e["action"], e["outcome"]) for e in events] == [
        ("deny", "not_found"), ("deny", "not_found"), ("deny", "rate_limited")
    ]  # fmt: skip
    limited = events[-1]
    assert limited["request_id"] == "req-limited"
    assert limited["client_address"] == "127.0.0.1"
    assert limited["detail"] == {"scope": "not_found"}


async def test_a_create_over_the_cap_records_a_cap_exceeded_denial_T_SEC_10(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with serve(make_settings(database_url, max_active_tasks_per_requestor=1)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        first = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        _, body = await post(s, "tools/call", {"name": "hang", "arguments": {}, "task": {}}, "req-over-cap")
        assert "error" in body
        assert "result" not in body
        events = await audit_rows(database_url, "local")
        async with superuser(database_url) as conn:
            tasks = await conn.fetchval("SELECT count(*) FROM tasks")
    assert tasks == 1
    assert [(e["action"], e["outcome"], e["task_id"]) for e in events] == [
        ("create", "working", first),
        ("deny", "cap_exceeded", None),
    ]
    denial = events[1]
    assert denial["detail"] == {"scope": "requestor", "limit": 1, "current": 1, "tool": "hang"}
    assert denial["request_id"] == "req-over-cap"
    assert denial["client_address"] == "127.0.0.1"
    assert denial["subject"] == "local"


async def test_a_bad_token_records_an_auth_denial_in_the_unauthenticated_chain_T_SEC_10(
    database_url: str, http: httpx.AsyncClient
) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
    async with hosted(database_url) as (_issuer, running):
        headers = {"Accept": "application/json, text/event-stream", "Authorization": "Bearer not-a-token"}
        named = await http.post(running.url, json=body, headers={**headers, "X-Request-Id": "req-bad-token"})
        unnamed = await http.post(running.url, json=body, headers=headers)
    assert named.status_code == unnamed.status_code == 401
    assert named.headers["x-request-id"] == "req-bad-token"
    events = await audit_rows(database_url)
    assert {e["tenant_id"] for e in events} == {"-"}
    assert [e["seq"] for e in events] == [1, 2]
    for event, response in zip(events, (named, unnamed), strict=True):
        assert event["action"] == "deny"
        assert event["outcome"].startswith("auth:")
        assert event["request_id"] == response.headers["x-request-id"]
        assert event["client_address"] == "127.0.0.1"
        assert (event["subject"], event["client_id"], event["task_id"]) == ("", "", None)
    assert "not-a-token" not in json.dumps(events, default=str)  # tokens are never recorded
    assert_linked_without_gaps(events)


async def test_a_verified_token_without_the_required_scope_is_denied_with_its_auth_context_T_SEC_10(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with run_issuer(LocalIssuer()) as issuer:
        settings = make_settings(
            database_url, auth="oauth", oauth_issuer=issuer.url, oauth_required_scopes="tasks admin"
        )
        async with serve(settings) as running:
            token = issuer.mint(running.url, tenant_id="acme", sub="alice", scope="tasks")
            r = await http.post(
                running.url,
                json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}},
                headers={"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {token}"},
            )
    assert r.status_code == 403
    [denial] = await audit_rows(database_url)
    assert denial["action"] == "deny"
    assert denial["outcome"].startswith("auth:")
    assert denial["request_id"] == r.headers["x-request-id"]
    assert (denial["subject"], denial["client_id"]) == ("alice", "test-client")


async def test_concurrent_requests_number_a_tenant_chain_without_gaps_or_duplicates_T_SEC_10(
    s: RpcSession, server: RunningServer
) -> None:
    async def lookup(n: int) -> None:
        await s.error("tasks/get", {"taskId": f"unknown-{n}"})

    async def create(n: int) -> None:
        await s.call_tool_as_task("echo", {"text": str(n)})

    await asyncio.gather(*(lookup(n) for n in range(12)), *(create(n) for n in range(8)))
    database_url = server.settings.database_url or ""
    async with asyncio.timeout(15):
        while len([e for e in await audit_rows(database_url) if e["action"] == "complete"]) < 8:
            await asyncio.sleep(0.05)
    events = await audit_rows(database_url, "local")
    assert len(events) == 12 + 8 + 8
    assert_linked_without_gaps(events)


async def test_a_task_whose_runner_stopped_records_complete_failed_T_SEC_10(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with serve(make_settings(database_url)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        reaped = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        handed_back = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        async with asyncio.timeout(15), superuser(database_url) as conn:
            while await conn.fetchval("SELECT count(*) FROM tasks WHERE lease_owner IS NOT NULL") < 2:
                await asyncio.sleep(0.05)
            # The reaper's view of a runner that died: a lease of another owner, run out.
            await conn.execute(
                "UPDATE tasks SET lease_owner = 'a-runner-that-died', lease_expires_at = now() - interval '1 second'"
                " WHERE task_id = $1",
                reaped,
            )
        await wait_status(s, reaped, "failed")
    # Leaving the block shut the server down, which hands back (fails) the task it was still running.
    events = await audit_rows(database_url, "local")
    for task_id in (reaped, handed_back):
        event = only(events, action="complete", task_id=task_id)
        assert event["outcome"] == "failed"
        assert event["detail"] == {"kind": "failure", "reason": "runner_stopped"}
        assert event["subject"] == "local"
        assert event["request_id"] is None
    assert_linked_without_gaps(events)


async def test_an_invalid_elicitation_answer_is_not_recorded_in_the_clients_own_words_T_SEC_10(
    s: RpcSession, server: RunningServer
) -> None:
    """The outcome of an input event comes from a closed set; a client must not write free text
    (here a word that means something else in the trail) into it."""
    task_id = (await s.call_tool_as_task("confirm", {}))["task"]["taskId"]
    await wait_status(s, task_id, "input_required")
    final: dict[str, Any] = {}
    async for msg in s.stream("tasks/result", {"taskId": task_id}):
        if msg.get("method") == "elicitation/create":
            assert (await s.reply(msg["id"], {"action": "completed"})).status_code == 202
        final = msg
    assert final["error"]["code"] == -32602  # the tool refused the answer
    answered = only(await audit_rows(server.settings.database_url or "", "local"), action="input")
    assert answered["outcome"] != "completed"


# --- 2. atomicity: no change without its event ------------------------------------------------


async def test_a_change_whose_audit_event_cannot_be_written_is_not_made_T_SEC_10(
    s: RpcSession, server: RunningServer
) -> None:
    database_url = server.settings.database_url or ""
    hanging = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
    async with superuser(database_url) as conn:
        await conn.execute(f"REVOKE INSERT ON audit_events FROM {RECORD_ROLE}")
        try:
            r, created = await post(s, "tools/call", {"name": "echo", "arguments": {"text": "x"}, "task": {}}, "r1")
            assert r.status_code != 500
            assert "error" in created
            assert "result" not in created
            assert isinstance(created["error"]["code"], int)
            r, cancelled = await post(s, "tasks/cancel", {"taskId": hanging}, "r2")
            assert r.status_code != 500
            assert "error" in cancelled
            assert "result" not in cancelled
            assert await conn.fetchval("SELECT count(*) FROM tasks") == 1  # no task without its create event
            assert await conn.fetchval("SELECT status::text FROM tasks WHERE task_id = $1", hanging) == "working"
        finally:
            await conn.execute(f"GRANT INSERT ON audit_events TO {RECORD_ROLE}")
    assert [e["action"] for e in await audit_rows(database_url)] == ["create"]
    # With the grant back the same request goes through, with its event.
    assert (await s.result("tasks/cancel", {"taskId": hanging}))["status"] == "cancelled"
    events = await audit_rows(database_url)
    assert [(e["action"], e["outcome"]) for e in events] == [("create", "working"), ("cancel", "cancelled")]
    assert_linked_without_gaps(events)


# --- 3. append-only ---------------------------------------------------------------------------

CHANGES = {
    "UPDATE": "UPDATE audit_events SET outcome = 'forged'",
    "DELETE": "DELETE FROM audit_events",
    "TRUNCATE": "TRUNCATE audit_events",
}


async def as_tenant(conn: asyncpg.Connection, tenant: str, sql: str) -> Any:
    """One statement in a transaction scoped to a tenant, as the service's requests run."""
    async with conn.transaction():
        await conn.execute("SELECT set_config('app.tenant_id', $1, true)", tenant)
        return await conn.fetchval(sql)


@pytest.mark.parametrize("role", [APP_ROLE, RUNNER_ROLE])
async def test_the_service_roles_may_read_but_never_insert_change_or_remove_events_T_SEC_10(
    role: str, chain_of_four: str
) -> None:
    database_url = chain_of_four
    before = await audit_rows(database_url)
    conn = await asyncpg.connect(database_url, server_settings={"role": role})
    try:
        # The rows are visible to the role, so a refusal below is not a statement that matched nothing.
        assert await as_tenant(conn, "local", "SELECT count(*) FROM audit_events") == 4
        for verb, sql in CHANGES.items():
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await as_tenant(conn, "local", sql)
            assert await conn.fetchval("SELECT has_table_privilege($1, 'audit_events', $2)", role, verb) is False
        # Appending goes through audit_append only (issue 14, finding 5): no direct INSERT.
        assert await conn.fetchval("SELECT has_table_privilege($1, 'audit_events', 'SELECT')", role) is True
        assert await conn.fetchval("SELECT has_table_privilege($1, 'audit_events', 'INSERT')", role) is False
    finally:
        await conn.close()
    assert await audit_rows(database_url) == before


async def test_even_a_superuser_cannot_change_or_remove_events_while_the_trigger_is_on_T_SEC_10(
    chain_of_four: str,
) -> None:
    database_url = chain_of_four
    before = await audit_rows(database_url)
    async with superuser(database_url) as conn:
        for sql in (*CHANGES.values(), "UPDATE audit_events SET hash = prev_hash WHERE seq = 4"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(sql)
    assert await audit_rows(database_url) == before


# --- 4. verify ---------------------------------------------------------------------------------


async def test_verify_against_a_database_it_cannot_reach_says_so_in_one_line() -> None:
    """An operator's mistake (a wrong URL, a database not migrated) is a one-line error that says
    what is wrong, with exit 1, not a traceback."""
    done = await mcp_tasks_audit(f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere", "verify")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().startswith("mcp-tasks audit: cannot connect to MCP_TASKS_DATABASE_URL"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


async def test_verify_reports_an_intact_chain_with_exit_0_T_SEC_10(chain_of_four: str) -> None:
    """The command itself: its exit code and its lines."""
    runs = await asyncio.gather(
        *(mcp_tasks_audit(chain_of_four, "verify", *args) for args in ((), ("--tenant", "local")))
    )
    for done in runs:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "intact" in done.stdout
        assert broken(done.stdout) == set()
        assert "BROKEN" not in done.stdout


TAMPERING: dict[str, tuple[tuple[str, ...], set[int]]] = {
    # name: (statements, seqs that must be named BROKEN)
    "changed-row": (("UPDATE audit_events SET outcome = 'failed' WHERE tenant_id = 'local' AND seq = 2",), {2}),
    "removed-middle-row": (("DELETE FROM audit_events WHERE tenant_id = 'local' AND seq = 2",), {3}),
    "removed-first-row": (("DELETE FROM audit_events WHERE tenant_id = 'local' AND seq = 1",), {2}),
    "removed-last-row": (("DELETE FROM audit_events WHERE tenant_id = 'local' AND seq = 4",), {4}),
    "reordered-rows": (
        (
            # Swap everything but the position: rows 2 and 3 trade places in the chain.
            """UPDATE audit_events a SET at = b.at, action = b.action, outcome = b.outcome, subject = b.subject,
                   client_id = b.client_id, issuer = b.issuer, task_id = b.task_id, request_id = b.request_id,
                   client_address = b.client_address, detail = b.detail, prev_hash = b.prev_hash, hash = b.hash
               FROM audit_events b
               WHERE a.tenant_id = 'local' AND b.tenant_id = 'local'
                 AND ((a.seq = 2 AND b.seq = 3) OR (a.seq = 3 AND b.seq = 2))""",
        ),
        {2, 3},
    ),
    "re-hashed-row": (
        # A changed row given a new self-consistent hash still breaks the link to the next row.
        (
            """UPDATE audit_events e SET outcome = 'failed',
                   hash = sha256(e.prev_hash || convert_to(audit_canonical(
                       ROW(e.tenant_id, e.seq, e.at, e.action, 'failed', e.subject, e.client_id, e.issuer, e.task_id,
                           e.request_id, e.client_address, e.detail, e.prev_hash, e.hash)::audit_events), 'UTF8'))
               WHERE tenant_id = 'local' AND seq = 2""",
        ),
        {3},
    ),
}


@pytest.mark.parametrize("case", list(TAMPERING))
async def test_verify_detects_tampering_and_names_the_tenant_and_seq_T_SEC_10(case: str, chain_of_four: str) -> None:
    statements, seqs = TAMPERING[case]
    await tamper(chain_of_four, *statements)
    named = await verified(chain_of_four)
    assert named, "verify must fail"
    assert {("local", seq) for seq in seqs} <= named, named
    assert {tenant for tenant, _ in named} == {"local"}
    assert all(seq in {1, 2, 3, 4} for _, seq in named)
    assert await verified(chain_of_four, "local") == named


async def test_verify_detects_a_change_to_any_recorded_field_T_SEC_10(s: RpcSession, server: RunningServer) -> None:
    for n in range(10):
        await s.error("tasks/get", {"taskId": f"unknown-{n}"})
    changes = {
        1: "at = at + interval '1 second'",
        2: "action = 'retrieve'",
        3: "outcome = 'found'",
        4: "subject = 'mallory'",
        5: "client_id = 'other-client'",
        6: "issuer = 'https://evil.example'",
        7: "task_id = 'another-task'",
        8: "request_id = 'another-request'",
        9: "client_address = '10.0.0.66'",
        10: """detail = '{"forged": true}'""",
    }
    database_url = server.settings.database_url or ""
    await tamper(database_url, *(f"UPDATE audit_events SET {c} WHERE seq = {n}" for n, c in changes.items()))
    done = await mcp_tasks_audit(database_url, "verify")  # the command itself: exit 1, a BROKEN line each
    assert done.returncode == 1
    assert broken(done.stdout) == {("local", n) for n in changes}, done.stdout


async def test_verify_does_not_depend_on_the_session_time_zone_or_date_style_T_SEC_10(chain_of_four: str) -> None:
    async with superuser(chain_of_four) as conn:
        name = await conn.fetchval("SELECT current_database()")
        await conn.execute(f"ALTER DATABASE \"{name}\" SET TimeZone = 'Asia/Kathmandu'")
        await conn.execute(f"ALTER DATABASE \"{name}\" SET DateStyle = 'SQL, DMY'")
    assert await verified(chain_of_four) == set()  # its connections are opened now, with those settings


# --- 5. export ---------------------------------------------------------------------------------


async def test_export_writes_every_field_as_json_lines_in_chain_order_T_SEC_10(chain_of_four: str) -> None:
    """The command itself: the JSON lines it writes."""
    done = await mcp_tasks_audit(chain_of_four, "export", "--tenant", "local")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    exported = [json.loads(line) for line in lines]
    assert [e["seq"] for e in exported] == [1, 2, 3, 4]
    assert all(set(e) == FIELDS for e in exported)
    assert [e["action"] for e in exported] == ["create", "complete", "retrieve", "deny"]
    assert exported[0]["prev_hash"] == GENESIS
    assert [e["prev_hash"] for e in exported[1:]] == [e["hash"] for e in exported[:-1]]
    stored = await audit_rows(chain_of_four, "local")
    for line, row in zip(exported, stored[:4], strict=True):
        assert {k: v for k, v in line.items() if k != "at"} == {k: v for k, v in row.items() if k != "at"}
        assert line["at"] == row["at"].isoformat()
    # A full export is recorded in the chain after what it wrote (issue 42 §4): how far, and by whom.
    assert [(r["seq"], r["action"]) for r in stored[4:]] == [(5, "export")]
    assert stored[4]["detail"]["through_seq"] == 4


async def test_export_since_keeps_only_events_from_that_time_on_T_SEC_10(chain_of_four: str) -> None:
    assert await exported(chain_of_four, "local", since="2999-01-01T00:00:00+00:00") == []
    third = (await audit_rows(chain_of_four, "local"))[2]["at"].isoformat()
    assert [e["seq"] for e in await exported(chain_of_four, "local", since=third)] == [3, 4]
    assert await exported(chain_of_four, "nobody") == []


# --- 6. tenants -------------------------------------------------------------------------------


async def test_each_tenant_has_its_own_chain_starting_at_seq_1_T_SEC_10(
    database_url: str, http: httpx.AsyncClient
) -> None:
    async with hosted(database_url) as (issuer, running):
        acme = RpcSession(http, running.url, token=issuer.mint(running.url, tenant_id="acme", sub="alice"))
        globex = RpcSession(http, running.url, token=issuer.mint(running.url, tenant_id="globex", sub="bob"))
        for session in (acme, globex):
            await session.initialize()
        a1 = (await acme.call_tool_as_task("echo", {"text": "a"}))["task"]["taskId"]
        g1 = (await globex.call_tool_as_task("echo", {"text": "g"}))["task"]["taskId"]
        a2 = (await acme.call_tool_as_task("hang", {}))["task"]["taskId"]
        await acme.result("tasks/cancel", {"taskId": a2})
        await globex.error("tasks/get", {"taskId": a1})  # another tenant's task: not found, in globex's chain
        for session, task_id in ((acme, a1), (globex, g1)):  # their completes are in before the chains are read
            async with asyncio.timeout(10):
                while (await session.result("tasks/get", {"taskId": task_id}))["status"] != "completed":
                    await asyncio.sleep(0.02)
        events = await audit_rows(database_url)
        issuer_url = issuer.url
    acme_chain = [e for e in events if e["tenant_id"] == "acme"]
    globex_chain = [e for e in events if e["tenant_id"] == "globex"]
    assert [(e["action"], e["task_id"]) for e in acme_chain if e["action"] != "complete"] == [
        ("create", a1), ("create", a2), ("cancel", a2)
    ]  # fmt: skip
    assert [(e["action"], e["task_id"]) for e in globex_chain if e["action"] != "complete"] == [
        ("create", g1), ("deny", a1)
    ]  # fmt: skip
    assert {e["subject"] for e in acme_chain} == {"alice"}
    assert {e["subject"] for e in globex_chain} == {"bob"}
    created = only(acme_chain, action="create", task_id=a1)
    assert (created["client_id"], created["issuer"]) == ("test-client", issuer_url)
    assert acme_chain[0]["seq"] == globex_chain[0]["seq"] == 1
    assert acme_chain[0]["prev_hash"] == globex_chain[0]["prev_hash"] == GENESIS
    assert_linked_without_gaps(events)
    # Breaking one tenant's chain leaves the other's intact.
    await tamper(database_url, "UPDATE audit_events SET outcome = 'forged' WHERE tenant_id = 'acme' AND seq = 1")
    assert await verified(database_url, "globex") == set()
    everything = await verified(database_url)
    assert everything, "verify must fail"
    assert {tenant for tenant, _ in everything} == {"acme"}
    assert [(e["tenant_id"], e["seq"]) for e in await exported(database_url, "globex")] == [
        ("globex", e["seq"]) for e in globex_chain
    ]


@pytest.mark.parametrize(("trusted", "expected"), [("127.0.0.1", "203.0.113.9"), ("", "127.0.0.1")])
async def test_client_address_comes_from_a_trusted_proxy_only(
    database_url: str, http: httpx.AsyncClient, trusted: str, expected: str
) -> None:
    """Behind a proxy named in MCP_TASKS_FORWARDED_ALLOW_IPS the audit trail records the real client;
    otherwise X-Forwarded-For is ignored (a client cannot choose its recorded address)."""
    async with serve(make_settings(database_url, forwarded_allow_ips=trusted)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        r = await http.post(
            running.url,
            json=s.message("tools/call", {"name": "echo", "arguments": {"text": "x"}, "task": {}}),
            headers=s.headers(**{"X-Forwarded-For": "203.0.113.9"}),
        )
        assert r.status_code == 200
    [created] = [e for e in await audit_rows(database_url) if e["action"] == "create"]
    assert created["client_address"] == expected
