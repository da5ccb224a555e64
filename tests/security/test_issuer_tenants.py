"""Issue 14 finding 10: with several trusted issuers, no issuer can act for another issuer's tenant,
and two issuers allowed for one tenant never share a subject's tasks, on either wire."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from pydantic import ValidationError

from tests.conftest import RunningServer, make_settings, run_issuer, serve
from tests.ext import V2026Client
from tests.issuer import LocalIssuer
from tests.rpc import RpcSession
from tests.test_durability import ROOT

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
}


@contextlib.asynccontextmanager
async def two_issuers(database_url: str) -> AsyncIterator[tuple[RunningServer, LocalIssuer, LocalIssuer]]:
    """Issuer a speaks for acme and shared, issuer b for beta-* and shared; a is listed first."""
    async with run_issuer(LocalIssuer()) as a, run_issuer(LocalIssuer()) as b:
        settings = make_settings(
            database_url,
            auth="oauth",
            oauth_issuer=f"{a.url},{b.url}",
            oauth_issuer_tenants=f"{a.url}=acme,shared; {b.url}=beta-*,shared",
        )
        async with serve(settings) as server:
            yield server, a, b


async def test_an_issuer_naming_another_issuers_tenant_gets_401_and_a_denial_row(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 14 finding 10: an administrator of issuer b mints a token for a's tenant acme: 401
    invalid_token with a description, audited as a denial naming the issuer and the tenant."""
    async with two_issuers(database_url) as (server, a, b):
        forged = b.mint(server.url, tenant_id="acme", sub="mallory")
        r = await http.post(server.url, json=INITIALIZE, headers={"Authorization": f"Bearer {forged}"})
        assert r.status_code == 401
        challenge = r.headers["www-authenticate"]
        assert 'error="invalid_token"' in challenge
        assert "error_description=" in challenge
        for issuer, tenant in ((a, "acme"), (b, "beta-eu"), (a, "shared"), (b, "shared")):
            token = issuer.mint(server.url, tenant_id=tenant, sub="alice")
            await RpcSession(http, server.url, token=token).initialize()  # each speaks for its own
        db = await asyncpg.connect(database_url)
        try:
            rows = await db.fetch("SELECT tenant_id, outcome, detail FROM audit_events WHERE action = 'deny'")
        finally:
            await db.close()
    assert [(r["tenant_id"], r["outcome"]) for r in rows] == [("-", "auth:tenant_not_allowed")]
    assert json.loads(rows[0]["detail"]) == {"issuer": b.url, "tenant": "acme"}


async def test_two_issuers_of_one_tenant_never_share_a_subjects_tasks_on_either_wire(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 14 finding 10: alice of issuer a and alice of issuer b, both allowed for tenant shared,
    are two principals: neither sees the other's tasks on 2025-11-25 or 2026-07-28. The first
    issuer keeps the plain subject (its existing rows stay its own); the second's is qualified."""
    async with two_issuers(database_url) as (server, a, b):
        token_a = a.mint(server.url, tenant_id="shared", sub="alice")
        token_b = b.mint(server.url, tenant_id="shared", sub="alice")
        legacy_a, legacy_b = RpcSession(http, server.url, token=token_a), RpcSession(http, server.url, token=token_b)
        await legacy_a.initialize()
        await legacy_b.initialize()
        mine = (await legacy_a.call_tool_as_task("sleep", {"seconds": 30}))["task"]["taskId"]
        assert (await legacy_b.error("tasks/get", {"taskId": mine}))["code"] == -32602
        assert (await legacy_b.result("tasks/list"))["tasks"] == []
        assert [t["taskId"] for t in (await legacy_a.result("tasks/list"))["tasks"]] == [mine]
        modern_a, modern_b = (
            V2026Client(http, server.url, token=token_a),
            V2026Client(http, server.url, token=token_b),
        )
        theirs = (await modern_b.result("tools/call", {"name": "sleep", "arguments": {"seconds": 30}}))["taskId"]
        assert (await modern_a.error("tasks/get", {"taskId": theirs}))["code"] == -32602
        assert (await modern_b.result("tasks/get", {"taskId": theirs}))["status"] == "working"
        db = await asyncpg.connect(database_url)
        try:
            subjects = dict(await db.fetch("SELECT task_id, subject FROM tasks WHERE tenant_id = 'shared'"))
        finally:
            await db.close()
    assert subjects == {mine: "alice", theirs: f"{b.url}#alice"}


async def test_the_first_issuers_subject_cannot_take_the_form_of_anothers(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 14 finding 10: issuer a cannot mint a sub that equals b's qualified subject in a tenant
    both speak for, so it cannot reach b's alice that way."""
    async with two_issuers(database_url) as (server, a, b):
        token = a.mint(server.url, tenant_id="shared", sub=f"{b.url}#alice")
        r = await http.post(server.url, json=INITIALIZE, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401
        assert 'error="invalid_token"' in r.headers["www-authenticate"]


def test_several_issuers_without_a_tenant_map_are_refused_at_start_up(database_url: str) -> None:
    """Issue 14 finding 10: several issuers sharing one tenant namespace is the attack: refused,
    naming the setting; so is a map naming an issuer that is not trusted."""
    with pytest.raises(ValidationError, match="MCP_TASKS_OAUTH_ISSUER_TENANTS"):
        make_settings(database_url, auth="oauth", oauth_issuer="https://a.example,https://b.example")
    with pytest.raises(ValidationError, match="does not trust"):
        make_settings(
            database_url,
            auth="oauth",
            oauth_issuer="https://a.example",
            oauth_issuer_tenants="https://a.example=acme;https://c.example=*",
        )
    with pytest.raises(ValidationError, match="issuer=tenant"):
        make_settings(database_url, auth="oauth", oauth_issuer="https://a.example", oauth_issuer_tenants="acme")
    one = make_settings(database_url, auth="oauth", oauth_issuer="https://a.example/")
    assert one.issuer_tenants == {}  # a single issuer needs no map and speaks for any tenant, as before


@pytest.mark.parametrize(
    ("tenants", "named"),
    [
        ("https://a.example=acme;https://b.example=*", ["https://b.example", "'*'", "'acme'", "https://a.example"]),
        ("https://a.example=*.eu;https://b.example=acme,x*", ["https://b.example", "'x*'", "'*.eu'"]),
    ],
)
def test_an_issuers_wildcard_covering_another_issuers_tenant_is_refused_at_start_up(
    database_url: str, tenants: str, named: list[str]
) -> None:
    """Issue 42 §6 (with `A=acme;B=*`, B's users entered A's tenant, shared its cap and wrote into its
    audit chain, with no warning): refused, naming both issuers and the patterns, unless the
    operator says the overlap is meant; a tenant both name explicitly is shared on purpose."""
    issuers = "https://a.example,https://b.example"
    with pytest.raises(ValidationError) as refused:
        make_settings(database_url, auth="oauth", oauth_issuer=issuers, oauth_issuer_tenants=tenants)
    for part in [*named, "MCP_TASKS_OAUTH_ISSUER_WILDCARD_OVERLAP"]:
        assert part in str(refused.value)
    meant = make_settings(database_url, auth="oauth", oauth_issuer=issuers, oauth_issuer_tenants=tenants,
                          oauth_issuer_wildcard_overlap=True)  # fmt: skip
    assert len(meant.issuer_tenants) == 2
    shared = "https://a.example=acme,shared;https://b.example=beta-*,shared"
    assert make_settings(database_url, auth="oauth", oauth_issuer=issuers, oauth_issuer_tenants=shared)


def test_serve_with_overlapping_issuer_wildcards_stops_with_one_line() -> None:
    env = {**os.environ, "MCP_TASKS_AUTH": "oauth", "MCP_TASKS_OAUTH_ISSUER": "https://a.example,https://b.example",
           "MCP_TASKS_OAUTH_ISSUER_TENANTS": "https://a.example=acme;https://b.example=*",
           "MCP_TASKS_DATABASE_URL": "postgresql://unused/x"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "service", "serve"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "https://b.example may speak for '*', which also covers 'acme' of https://a.example" in last
