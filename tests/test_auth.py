"""Hosted mode: OAuth resource server, token validation, challenges, and binding to the principal
(spec/TRANSPORT-AND-AUTH.md A-*, TASKS-REQUIREMENTS.md T-SEC-*). Real signed JWTs, a real JWKS over HTTP."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from joserfc.jwk import ECKey

from service.config import Settings
from tests.conftest import RunningServer, fresh_database, make_settings, run_issuer, serve
from tests.issuer import LocalIssuer, b64, unsigned
from tests.rpc import ACCEPT_BOTH, RpcSession

INIT = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {"elicitation": {}},
        "clientInfo": {"name": "t", "version": "1"},
    },
}


@pytest.fixture(scope="module")
async def issuer() -> AsyncIterator[LocalIssuer]:
    """One issuer for the module. Tests that make it slow or down, or count its JWKS fetches,
    run one of their own."""
    async with run_issuer(LocalIssuer()) as running:
        yield running


@pytest.fixture(scope="module")
async def hosted(admin_dsn: str, template_db: str, issuer: LocalIssuer) -> AsyncIterator[RunningServer]:
    """One hosted-mode server for the module; tests bind to principals of their own (``tenant``)."""
    async with fresh_database(admin_dsn, template_db) as url, serve(hosted_settings(url, issuer)) as running:
        yield running


def hosted_settings(database_url: str, issuer: LocalIssuer) -> Settings:
    return make_settings(
        database_url,
        auth="oauth",
        oauth_issuer=issuer.url,
        oauth_introspection_url=f"{issuer.url}/introspect",
        oauth_http_timeout_s=1.0,
    )


@pytest.fixture
def tenant() -> str:
    """A tenant of this test's own on the module's shared server."""
    return f"t-{secrets.token_hex(6)}"


def audience(server: RunningServer) -> str:
    return server.url


async def post(
    http: httpx.AsyncClient, url: str, token: str | None, body: Any = INIT, **headers: str
) -> httpx.Response:
    h = {"Accept": ACCEPT_BOTH, "Content-Type": "application/json", **headers}
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    return await http.post(url, json=body, headers=h)


async def session_for(http: httpx.AsyncClient, server: RunningServer, token: str) -> RpcSession:
    s = RpcSession(http, server.url, token=token)
    await s.initialize()
    return s


def _hs256_with_public_key(issuer: LocalIssuer, aud: str) -> str:
    key = issuer.keys[0]
    assert isinstance(key, ECKey)
    secret = key.as_pem(private=False)
    header, claims = {"alg": "HS256", "typ": "at+jwt", "kid": key.kid}, issuer.claims(aud)
    signing_input = unsigned(header, claims).rsplit(".", 1)[0]
    sig = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(sig)}"


def _tampered(issuer: LocalIssuer, aud: str) -> str:
    good = issuer.mint(aud)
    header, _payload, sig = good.split(".")
    evil = unsigned({}, issuer.claims(aud, tenant_id="victim")).split(".")[1]
    return f"{header}.{evil}.{sig}"


BAD_TOKENS: dict[str, Callable[[LocalIssuer, str], str]] = {
    "garbage": lambda i, a: "not-a-token",
    "garbage-jwt-shape": lambda i, a: "abc.def.ghi",
    "alg-none": lambda i, a: unsigned({"alg": "none", "typ": "at+jwt"}, i.claims(a)),
    "hs256-signed-with-public-key": _hs256_with_public_key,
    "unknown-kid": lambda i, a: i.mint(a, key=ECKey.generate_key("P-256", parameters={"kid": "stranger"})),
    "right-kid-wrong-key": lambda i, a: i.mint(a, key=ECKey.generate_key("P-256", parameters={"kid": "key-1"})),
    "tampered-payload": _tampered,
    "expired": lambda i, a: i.mint(a, exp=int(time.time()) - 3600, iat=int(time.time()) - 7200, nbf=None),
    "not-yet-valid": lambda i, a: i.mint(a, nbf=int(time.time()) + 3600),
    "wrong-issuer": lambda i, a: i.mint(a, iss="https://evil.example.com"),
    "missing-audience": lambda i, a: i.mint(a, aud=None),
    "wrong-audience": lambda i, a: i.mint(a, aud="https://other.example.com/mcp"),
    "missing-subject": lambda i, a: i.mint(a, sub=None),
    "missing-tenant": lambda i, a: i.mint(a, tenant_id=None),
    "reserved-tenant": lambda i, a: i.mint(a, tenant_id="-"),
    "alg-as-a-list": lambda i, a: unsigned({"alg": ["ES256"], "typ": "at+jwt"}, i.claims(a)),
    "scope-not-a-string": lambda i, a: i.mint(a, scope=5),
    "nbf-not-a-number": lambda i, a: i.mint(a, nbf="tomorrow"),
    "id-token-type": lambda i, a: i.mint(a, header={"typ": "id_token+jwt"}),
    "inactive-opaque": lambda i, a: "opaque-but-inactive",
}


@pytest.mark.parametrize("kind", sorted(BAD_TOKENS))
async def test_bad_tokens_get_401_invalid_token_with_a_usable_challenge_A_TOK_3_A_ERR_1(
    kind: str, hosted: RunningServer, issuer: LocalIssuer, http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    token = BAD_TOKENS[kind](issuer, audience(hosted))
    with caplog.at_level(logging.WARNING, logger="service.auth"):
        async with asyncio.timeout(10):  # bounded: a bad token never hangs a request
            r = await post(http, hosted.url, token)
    assert r.status_code == 401, r.text
    challenge = r.headers["www-authenticate"]
    assert challenge.startswith("Bearer ")
    assert 'error="invalid_token"' in challenge
    assert (
        f'resource_metadata="{hosted.url.removesuffix("/mcp")}/.well-known/oauth-protected-resource/mcp"' in challenge
    )
    assert 'scope="tasks"' in challenge
    assert r.json()["error"]["code"] == -32600
    denied = [rec.getMessage() for rec in caplog.records if "auth denied" in rec.getMessage()]
    assert denied, "an audit-friendly log line names the refusal"
    assert all(token not in rec.getMessage() for rec in caplog.records)


async def test_missing_token_gets_401_challenge_without_error_A_ERR_1_A_ERR_2(
    hosted: RunningServer, http: httpx.AsyncClient
) -> None:
    r = await post(http, hosted.url, None)
    assert r.status_code == 401
    challenge = r.headers["www-authenticate"]
    assert "resource_metadata=" in challenge
    assert 'scope="tasks"' in challenge
    assert "error=" not in challenge


@pytest.mark.parametrize("header", ["Basic dXNlcjpwYXNz", "Bearer", "Bearer a b", "bearer"])
async def test_malformed_authorization_header_is_401(
    hosted: RunningServer, http: httpx.AsyncClient, header: str
) -> None:
    r = await http.post(hosted.url, json=INIT, headers={"Accept": ACCEPT_BOTH, "Authorization": header})
    assert r.status_code == 401


async def test_token_in_query_string_is_refused_A_TOK_1(
    hosted: RunningServer, issuer: LocalIssuer, http: httpx.AsyncClient
) -> None:
    token = issuer.mint(audience(hosted))
    r = await http.post(f"{hosted.url}?access_token={token}", json=INIT, headers={"Accept": ACCEPT_BOTH})
    assert r.status_code == 401
    assert 'error="invalid_request"' in r.headers["www-authenticate"]


async def test_valid_token_is_accepted_and_uppercase_audience_matches_A_AUD_4(
    hosted: RunningServer, issuer: LocalIssuer, http: httpx.AsyncClient
) -> None:
    assert (await post(http, hosted.url, issuer.mint(audience(hosted)))).status_code == 200
    upper = audience(hosted).replace("http://127.0.0.1", "HTTP://127.0.0.1") + "/"
    assert (await post(http, hosted.url, issuer.mint(upper))).status_code == 200
    multi = [audience(hosted), "https://other.example.com"]
    assert (await post(http, hosted.url, issuer.mint(multi))).status_code == 200  # type: ignore[arg-type]


async def test_each_request_on_one_connection_is_its_own_tokens_T_SEC_2_A_TOK_3(
    hosted: RunningServer, issuer: LocalIssuer, tenant: str
) -> None:
    """The endpoint remembers a connection's Authorization header and its principal (a keep-alive
    client sends the same one each time): another token on the same connection is its own
    principal, and a bad one after a good one is refused."""
    aud = audience(hosted)
    alice_token, bob_token = (issuer.mint(aud, sub=sub, tenant_id=tenant) for sub in ("alice", "bob"))
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as one:
        alice, bob = await session_for(one, hosted, alice_token), await session_for(one, hosted, bob_token)
        task_id = (await alice.call_tool_as_task("sleep", {"seconds": 30}))["task"]["taskId"]
        for _ in range(2):  # back and forth on the one connection
            assert (await bob.error("tasks/get", {"taskId": task_id}))["code"] == -32602
            assert (await alice.result("tasks/get", {"taskId": task_id}))["status"] == "working"
        forged = _tampered(issuer, aud)
        refused = await post(one, hosted.url, forged, {"jsonrpc": "2.0", "id": 2, "method": "ping"})
        assert refused.status_code == 401
        assert (await alice.result("tasks/cancel", {"taskId": task_id}))["status"] == "cancelled"


async def test_a_token_that_runs_out_is_refused_on_the_connection_that_used_it_A_TOK_3(
    database_url: str, issuer: LocalIssuer
) -> None:
    settings = make_settings(database_url, auth="oauth", oauth_issuer=issuer.url, oauth_leeway_s=0)
    async with serve(settings) as server, httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as one:
        token = issuer.mint(audience(server), exp=int(time.time()) + 2)
        s = await session_for(one, server, token)
        assert await s.result("ping") == {}
        await asyncio.sleep(max(0.0, int(time.time()) + 1 - time.time()) + 2)  # past exp, whole seconds
        r = await post(one, server.url, token, {"jsonrpc": "2.0", "id": 3, "method": "ping"},
                       **{"Mcp-Session-Id": s.session_id or ""})  # fmt: skip
        assert r.status_code == 401
        assert "expired" in r.headers["www-authenticate"]


async def test_rsa_keys_work_too(database_url: str, http: httpx.AsyncClient) -> None:
    from joserfc.jwk import RSAKey

    rsa = RSAKey.generate_key(2048, parameters={"kid": "rsa-1", "alg": "RS256"})
    issuer = LocalIssuer(keys=[rsa])
    async with run_issuer(issuer), serve(make_settings(database_url, auth="oauth", oauth_issuer=issuer.url)) as server:
        assert (await post(http, server.url, issuer.mint(server.url))).status_code == 200


async def test_missing_required_scope_is_403_insufficient_scope_A_ERR_3(
    database_url: str, issuer: LocalIssuer, http: httpx.AsyncClient
) -> None:
    settings = make_settings(
        database_url, auth="oauth", oauth_issuer=issuer.url, oauth_required_scopes="tasks tasks:write"
    )
    async with serve(settings) as server:
        r = await post(http, server.url, issuer.mint(server.url, scope="tasks"))
        assert r.status_code == 403
        challenge = r.headers["www-authenticate"]
        assert 'error="insufficient_scope"' in challenge
        assert 'scope="tasks tasks:write"' in challenge
        assert (await post(http, server.url, issuer.mint(server.url, scope="tasks tasks:write"))).status_code == 200


async def test_protected_resource_metadata_at_both_well_known_paths_A_PRM_1_2_4_5(
    hosted: RunningServer, issuer: LocalIssuer, http: httpx.AsyncClient
) -> None:
    base = hosted.url.removesuffix("/mcp")
    for path in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"):
        r = await http.get(base + path)
        assert r.status_code == 200
        meta = r.json()
        assert meta["resource"] == hosted.url
        assert meta["authorization_servers"] == [issuer.url]
        assert meta["bearer_methods_supported"] == ["header"]


async def test_unknown_kid_refetches_the_jwks_once_after_key_rotation(
    database_url: str, http: httpx.AsyncClient
) -> None:
    # Its own issuer and server: it counts JWKS fetches, which other tests' unknown kids also cause.
    async with run_issuer(LocalIssuer()) as issuer, serve(hosted_settings(database_url, issuer)) as hosted:
        assert (await post(http, hosted.url, issuer.mint(audience(hosted)))).status_code == 200
        fetches = issuer.jwks_fetches
        new_key = issuer.rotate()
        assert (await post(http, hosted.url, issuer.mint(audience(hosted), key=new_key))).status_code == 200
        assert issuer.jwks_fetches == fetches + 1
        stranger = ECKey.generate_key("P-256", parameters={"kid": "stranger"})
        for _ in range(5):  # junk kids do not make us hammer the issuer
            assert (await post(http, hosted.url, issuer.mint(audience(hosted), key=stranger))).status_code == 401
        assert issuer.jwks_fetches == fetches + 1


async def test_down_or_slow_issuer_gives_503_not_a_hang(database_url: str, http: httpx.AsyncClient) -> None:
    issuer = LocalIssuer()  # its own: it makes the issuer slow, then down
    async with run_issuer(issuer):
        settings = make_settings(
            database_url, auth="oauth", oauth_issuer=issuer.url, oauth_http_timeout_s=0.5, oauth_jwks_min_refresh_s=0.5
        )
        async with serve(settings) as server:
            issuer.delay_s = 5
            async with asyncio.timeout(4):
                r = await post(http, server.url, issuer.mint(server.url))
            assert r.status_code == 503
            assert r.headers["retry-after"]
            issuer.delay_s, issuer.down = 0, True
            assert (await post(http, server.url, issuer.mint(server.url))).status_code == 503
            issuer.down = False
            async with asyncio.timeout(10):  # failures are remembered briefly (no pile-up), then it recovers
                while (await post(http, server.url, issuer.mint(server.url))).status_code != 200:
                    await asyncio.sleep(0.1)


async def test_opaque_token_by_introspection(
    hosted: RunningServer, issuer: LocalIssuer, http: httpx.AsyncClient, tenant: str
) -> None:
    claims = {
        "iss": issuer.url, "sub": "bob", "tenant_id": tenant, "client_id": "c", "scope": "tasks",
        "exp": int(time.time()) + 600, "aud": audience(hosted),
    }  # fmt: skip
    issuer.active_opaque[f"{tenant}-good"] = claims
    s = await session_for(http, hosted, f"{tenant}-good")
    assert (await s.result("tasks/list"))["tasks"] == []
    # A-AUD-1: an introspection answer must say the token is for us; a refresh token is not an access token.
    issuer.active_opaque[f"{tenant}-no-aud"] = {k: v for k, v in claims.items() if k != "aud"}
    issuer.active_opaque[f"{tenant}-refresh"] = {**claims, "token_type": "refresh_token"}
    for token in (f"{tenant}-no-aud", f"{tenant}-refresh"):
        assert (await post(http, hosted.url, token)).status_code == 401, token


# --- binding to the principal (T-SEC-1/2, T-CREATE-10, H-SESS-7) ----------------------------------


@pytest.fixture
async def principals(
    hosted: RunningServer, issuer: LocalIssuer, http: httpx.AsyncClient, tenant: str
) -> dict[str, RpcSession]:
    aud = audience(hosted)
    return {
        "alice": await session_for(http, hosted, issuer.mint(aud, sub="alice", tenant_id=tenant)),
        "bob": await session_for(http, hosted, issuer.mint(aud, sub="bob", tenant_id=tenant)),
        "alice@globex": await session_for(http, hosted, issuer.mint(aud, sub="alice", tenant_id=f"{tenant}-globex")),
    }


async def test_other_subject_and_other_tenant_get_not_found_exactly_like_an_unknown_id_T_SEC_2(
    principals: dict[str, RpcSession],
) -> None:
    alice = principals["alice"]
    task_id = (await alice.call_tool_as_task("sleep", {"seconds": 30}))["task"]["taskId"]
    unknown = {
        m: await alice.error(m, {"taskId": "no-such-task"}) for m in ("tasks/get", "tasks/result", "tasks/cancel")
    }
    for intruder in ("bob", "alice@globex"):
        s = principals[intruder]
        for method, expected in unknown.items():
            error = await s.error(method, {"taskId": task_id})
            assert error["code"] == expected["code"] == -32602
            assert error["message"] == expected["message"]
            assert set(error) == set(expected)
        assert (await s.result("tasks/list"))["tasks"] == []
    assert (await alice.result("tasks/get", {"taskId": task_id}))["status"] == "working"
    assert [t["taskId"] for t in (await alice.result("tasks/list"))["tasks"]] == [task_id]
    await alice.result("tasks/cancel", {"taskId": task_id})


async def test_another_principal_cannot_answer_a_tasks_elicitation_T_SEC_13(
    principals: dict[str, RpcSession],
) -> None:
    alice, bob = principals["alice"], principals["bob"]
    task_id = (await alice.call_tool_as_task("confirm", {}))["task"]["taskId"]
    async with asyncio.timeout(10):
        while (await alice.result("tasks/get", {"taskId": task_id}))["status"] != "input_required":
            await asyncio.sleep(0.05)
    request_id = None
    async for msg in alice.stream("tasks/result", {"taskId": task_id}):
        if msg.get("method") == "elicitation/create":
            request_id = msg["id"]
            break
    assert request_id is not None
    # An answer is stored before its 202 (the first answer to a question wins): bob's was refused
    # by then, or the tool below would have been given ok=True instead of alice's later answer.
    assert (await bob.reply(request_id, {"action": "accept", "content": {"ok": True}})).status_code == 202
    assert (await alice.result("tasks/get", {"taskId": task_id}))["status"] == "input_required"
    await alice.reply(request_id, {"action": "accept", "content": {"ok": False}})
    result = await alice.result("tasks/result", {"taskId": task_id})
    assert result["content"][0]["text"] == "answer: ok=False"


async def test_a_session_presented_with_another_principals_token_is_404_H_SESS_7(
    principals: dict[str, RpcSession], http: httpx.AsyncClient
) -> None:
    alice, bob = principals["alice"], principals["bob"]
    hijack = {**bob.headers(), "Mcp-Session-Id": alice.session_id or ""}
    r = await http.post(alice.url, json={"jsonrpc": "2.0", "id": 5, "method": "ping"}, headers=hijack)
    assert r.status_code == 404


async def test_a_new_session_of_the_same_principal_reaches_its_tasks_H_SESS_8(
    hosted: RunningServer, issuer: LocalIssuer, http: httpx.AsyncClient, principals: dict[str, RpcSession], tenant: str
) -> None:
    task_id = (await principals["alice"].call_tool_as_task("echo", {"text": "mine"}))["task"]["taskId"]
    again = await session_for(
        http, hosted, issuer.mint(audience(hosted), sub="alice", tenant_id=tenant, client_id="another")
    )
    assert (await again.result("tasks/result", {"taskId": task_id}))["content"][0]["text"] == "mine"


@pytest.mark.parametrize(
    ("claims", "why"),
    [
        ({"sub": "a" * 3000}, "a 3,000-character subject overflowed an index row: -32603 on every create"),
        ({"sub": "alice\x00"}, "a NUL in a claim was a 503"),
        ({"sub": "alice\ninjected log line"}, "a newline would forge a log line"),
        ({"tenant_id": "t" * 300}, "tenants are bounded too"),
        ({"aud": "FRAGMENT"}, "an audience with a fragment was accepted"),
    ],
)
async def test_identity_claims_are_bounded_and_clean_and_aud_has_no_fragment(
    shared_server: RunningServer, shared_issuer: LocalIssuer, http: httpx.AsyncClient, claims: dict[str, Any], why: str
) -> None:
    """Security review, point 9: each is a clear 401, never a 500 or 503."""
    if claims.get("aud") == "FRAGMENT":
        claims = {"aud": shared_server.url + "#fragment"}
    token = shared_issuer.mint(shared_server.url, **{"tenant_id": "t-claims", "sub": "alice", **claims})
    r = await http.post(shared_server.url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                        headers={"Authorization": f"Bearer {token}", "Accept": ACCEPT_BOTH, "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 401, (why, r.status_code, r.text)
    assert "invalid_token" in r.headers["www-authenticate"]
