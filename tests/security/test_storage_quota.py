"""Issue 42 §6: a tenant's tasks keep at most MCP_TASKS_TENANT_STORAGE_QUOTA_BYTES (arguments,
capabilities and progress tokens as stored, and results) until they expire. The attack: one
principal wrote about 560 MB a minute of large tasks, kept up to 24 h. Now a create past the quota is
refused with its own code (-32004; 2026-07-28: -31004), audited, and counted; other tenants are not
touched; the room comes back as the tasks expire."""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx

from tests.conftest import RunningServer, http_client, make_settings, run_issuer, serve
from tests.ext import V2026Client
from tests.issuer import LocalIssuer
from tests.rpc import RpcSession

QUOTA = 1_000_000
TEXT = 100_000  # characters of each task's argument: about a tenth of the quota


@contextlib.asynccontextmanager
async def hosted(database_url: str, **overrides: Any) -> AsyncIterator[tuple[RunningServer, LocalIssuer]]:
    async with run_issuer(LocalIssuer()) as issuer:
        settings = make_settings(database_url, auth="oauth", oauth_issuer=issuer.url,
                                 tenant_storage_quota_bytes=QUOTA, **overrides)  # fmt: skip
        async with serve(settings) as server:
            yield server, issuer


async def session(http: httpx.AsyncClient, server: RunningServer, issuer: LocalIssuer, tenant: str) -> RpcSession:
    s = RpcSession(http, server.url, token=issuer.mint(server.url, tenant_id=tenant, sub="alice"))
    await s.initialize()
    return s


def big_text() -> str:
    return secrets.token_hex(TEXT // 2)  # incompressible, as an attacker's would be


async def fill(s: RpcSession, ttl_ms: int) -> tuple[int, dict[str, Any]]:
    """Create large tasks until the quota refuses one: how many were accepted, and the refusal."""
    for accepted in range(30):
        reply = await s.send("tools/call", {"name": "echo", "arguments": {"text": big_text()}, "task": {"ttl": ttl_ms}})
        if "error" in reply:
            return accepted, reply["error"]
    raise AssertionError("30 tasks of 100 KB each were accepted under a quota of 1 MB")


async def stored_bytes(http: httpx.AsyncClient, server: RunningServer) -> float:
    text = (await http.get(server.url.removesuffix("/mcp") + "/metrics")).text
    found = re.search(r"^mcp_tasks_storage_bytes(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert found is not None, "mcp_tasks_storage_bytes is not exported"
    return float(found.group(1))


async def test_a_tenant_past_its_storage_quota_is_refused_on_both_wires_and_others_are_not(
    database_url: str,
) -> None:
    """No runner here: the tasks stay queued, keeping their arguments. Nine of about 100 KB fit in
    1 MB; the next create is refused with -32004 naming the scope, the quota and the bytes kept, on
    2026-07-28 with -31004; another tenant creates as before; the refusal is in the audit trail."""
    async with hosted(database_url, runner_concurrency=0) as (server, issuer), http_client() as http:
        flood = await session(http, server, issuer, "tenant-a")
        accepted, refused = await fill(flood, 3_600_000)
        assert 7 <= accepted <= 10, accepted  # about QUOTA / TEXT, less the rows' own overhead
        assert refused["code"] == -32004, refused
        assert refused["data"]["scope"] == "storage"
        assert refused["data"]["limit"] == QUOTA
        assert QUOTA - 2 * TEXT < refused["data"]["current"] <= QUOTA
        assert "storage quota" in refused["message"]

        modern = V2026Client(http, server.url, token=issuer.mint(server.url, tenant_id="tenant-a", sub="bob"))
        error = await modern.error("tools/call", {"name": "echo", "arguments": {"text": big_text()}})
        assert (error["code"], error["data"]["scope"]) == (-31004, "storage")

        other = await session(http, server, issuer, "tenant-b")
        created = await other.call_tool_as_task("echo", {"text": big_text()})
        assert created["task"]["status"] == "working"

        conn = await asyncpg.connect(database_url)
        try:
            denials = await conn.fetch(
                "SELECT subject, detail FROM audit_events WHERE tenant_id = 'tenant-a' AND action = 'deny' "
                "AND outcome = 'quota_exceeded' ORDER BY seq"
            )
        finally:
            await conn.close()
        assert [d["subject"] for d in denials] == ["alice", "bob"]


async def test_results_count_and_the_room_comes_back_as_tasks_expire(database_url: str) -> None:
    """Tasks that run keep their results too (an echo keeps its text twice), so fewer fit; once they
    expire the sweeper's deletes give the bytes back: the gauge reads 0 and creates pass again."""
    async with hosted(database_url, min_ttl_ms=1_000) as (server, issuer), http_client() as http:
        flood = await session(http, server, issuer, "tenant-a")
        accepted, refused = await fill(flood, 1_000)
        assert 3 <= accepted <= 6, accepted  # each keeps its argument and its result: about 200 KB
        assert refused["code"] == -32004
        async with asyncio.timeout(20):
            while await stored_bytes(http, server) < QUOTA / 2:  # the next sweep reads what is kept
                await asyncio.sleep(0.1)
            while await stored_bytes(http, server) > 0:  # deleted as they expire, and given back
                await asyncio.sleep(0.1)
        created = await flood.call_tool_as_task("echo", {"text": big_text()})
        assert created["task"]["status"] in ("working", "completed")
