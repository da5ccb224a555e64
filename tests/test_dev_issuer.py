"""The development OAuth issuer, served by a real uvicorn and used over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import uvicorn
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc import jwt
from joserfc.jwk import KeySet

from service.auth.dev_issuer import DEV_HEADER, create_dev_issuer_app
from service.auth.dev_issuer_cli import request_token
from service.auth.dev_keys import DevIssuerConfig, load_or_create_signing_key, mint_access_token
from tests.conftest import PromptServer, listening_socket

AUDIENCE = "http://127.0.0.1:8000/mcp"
REDIRECT = "http://127.0.0.1:33418/callback"


@dataclass
class Issuer:
    url: str
    config: DevIssuerConfig


@contextlib.asynccontextmanager
async def serve_issuer(key_path: Path | None = None, path: str = "") -> AsyncIterator[Issuer]:
    """create_dev_issuer_app on a free loopback port, served by uvicorn in this event loop."""
    sock = listening_socket()
    config = DevIssuerConfig(
        issuer=f"http://127.0.0.1:{sock.getsockname()[1]}{path}", audience=AUDIENCE, key_path=key_path
    )
    app = create_dev_issuer_app(config)
    server = PromptServer(uvicorn.Config(app, lifespan="on", log_level="warning", ws="none"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.02)
        yield Issuer(config.issuer, config)
    finally:
        server.stop()
        await task
        sock.close()


@pytest.fixture
async def issuer(tmp_path: Path) -> AsyncIterator[Issuer]:
    async with serve_issuer(tmp_path / "keys" / "dev-issuer.jwk") as running:
        yield running


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0, follow_redirects=False) as c:
        yield c


async def verify(client: httpx.AsyncClient, issuer: Issuer, token: str, audience: str = AUDIENCE) -> dict[str, Any]:
    """The token's claims, after checking signature (served JWKS), typ, iss, aud and expiry."""
    keys = KeySet.import_key_set((await client.get(f"{issuer.url}/jwks")).json())
    decoded = jwt.decode(token, keys, algorithms=["ES256"])
    assert decoded.header["typ"] == "at+jwt"
    assert decoded.header["kid"] == keys.keys[0].kid
    jwt.JWTClaimsRegistry(
        iss={"essential": True, "value": issuer.url},
        aud={"essential": True, "value": audience},
        exp={"essential": True},
        sub={"essential": True},
        jti={"essential": True},
    ).validate(decoded.claims)
    return decoded.claims


async def register(client: httpx.AsyncClient, issuer: Issuer, **metadata: Any) -> dict[str, Any]:
    body = {
        "redirect_uris": [REDIRECT],
        "grant_types": ["authorization_code", "refresh_token"],
        "token_endpoint_auth_method": "none",
        "client_name": "test client",
        **metadata,
    }
    response = await client.post(f"{issuer.url}/register", json=body)
    assert response.status_code == 201, response.text
    registered: dict[str, Any] = response.json()
    return registered


async def authorize(client: httpx.AsyncClient, issuer: Issuer, client_id: str, **params: str) -> httpx.Response:
    query = {"response_type": "code", "client_id": client_id, "redirect_uri": REDIRECT, "state": "st", **params}
    return await client.get(f"{issuer.url}/authorize", params=query)


async def code_for(client: httpx.AsyncClient, issuer: Issuer, client_id: str, verifier: str, **params: str) -> str:
    challenge = create_s256_code_challenge(verifier)
    response = await authorize(
        client, issuer, client_id, code_challenge=challenge, code_challenge_method="S256", **params
    )
    assert response.status_code == 302
    location = urlsplit(response.headers["location"])
    assert f"{location.scheme}://{location.netloc}{location.path}" == REDIRECT
    query = parse_qs(location.query)
    assert query["state"] == ["st"]
    assert query["iss"] == [issuer.url]
    code: str = query["code"][0]
    return code


async def exchange(
    client: httpx.AsyncClient, issuer: Issuer, client_id: str, code: str, verifier: str, **form: str
) -> httpx.Response:
    data = {
        "grant_type": "authorization_code",
        "client_id": client_id,
        "code": code,
        "code_verifier": verifier,
        "redirect_uri": REDIRECT,
        **form,
    }
    return await client.post(f"{issuer.url}/token", data=data)


def new_verifier() -> str:
    return secrets.token_urlsafe(48)


async def test_metadata_advertises_endpoints_s256_pkce_and_grants(issuer: Issuer, client: httpx.AsyncClient) -> None:
    for path in ("/.well-known/oauth-authorization-server", "/.well-known/openid-configuration"):
        response = await client.get(issuer.url + path)
        assert response.status_code == 200
        meta = response.json()
        assert meta["issuer"] == issuer.url
        assert meta["authorization_endpoint"] == f"{issuer.url}/authorize"
        assert meta["token_endpoint"] == f"{issuer.url}/token"
        assert meta["registration_endpoint"] == f"{issuer.url}/register"
        assert meta["jwks_uri"] == f"{issuer.url}/jwks"
        assert meta["response_types_supported"] == ["code"]
        assert set(meta["grant_types_supported"]) == {"authorization_code", "client_credentials", "refresh_token"}
        assert meta["code_challenge_methods_supported"] == ["S256"]
        assert set(meta["token_endpoint_auth_methods_supported"]) == {
            "client_secret_post",
            "client_secret_basic",
            "none",
        }
        assert meta["scopes_supported"] == ["tasks"]


async def test_issuer_with_a_path_serves_path_inserted_metadata(client: httpx.AsyncClient) -> None:
    async with serve_issuer(path="/dev") as issuer:
        response = await client.get(issuer.url.replace("/dev", "/.well-known/oauth-authorization-server/dev"))
        assert response.status_code == 200
        assert response.json()["token_endpoint"] == f"{issuer.url}/token"
        oidc = await client.get(issuer.url.replace("/dev", "/.well-known/openid-configuration/dev"))
        assert oidc.json()["issuer"] == issuer.url
        assert (await client.get(f"{issuer.url}/jwks")).status_code == 200


async def test_every_response_is_marked_development_only(issuer: Issuer, client: httpx.AsyncClient) -> None:
    responses = [
        await client.get(f"{issuer.url}/.well-known/oauth-authorization-server"),
        await client.get(f"{issuer.url}/jwks"),
        await client.post(f"{issuer.url}/token", data={"grant_type": "client_credentials"}),
        await client.get(f"{issuer.url}/no-such-page"),
    ]
    for response in responses:
        assert response.headers[DEV_HEADER] == "development only - never use in production"


async def test_minted_token_verifies_against_the_served_jwks(issuer: Issuer, client: httpx.AsyncClient) -> None:
    key = load_or_create_signing_key(issuer.config.key_path)
    token = mint_access_token(
        key, issuer.config, tenant="acme", subject="alice", client_id="cli", scope="tasks", audience=AUDIENCE
    )
    claims = await verify(client, issuer, token)
    assert claims["tenant_id"] == "acme"
    assert claims["sub"] == "alice"
    assert claims["client_id"] == "cli"
    assert claims["scope"] == "tasks"
    assert claims["exp"] - claims["iat"] == 3600
    assert claims["nbf"] <= claims["iat"]


async def test_client_credentials_token_carries_the_requested_tenant_and_subject(
    issuer: Issuer, client: httpx.AsyncClient
) -> None:
    form = {"grant_type": "client_credentials", "tenant": "acme", "subject": "bob", "scope": "tasks"}
    response = await client.post(f"{issuer.url}/token", data=form, auth=("dev", "dev"))
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    body = response.json()
    assert body["token_type"] == "Bearer"
    assert body["expires_in"] == 3600
    assert body["scope"] == "tasks"
    assert "refresh_token" not in body
    claims = await verify(client, issuer, body["access_token"])
    assert (claims["tenant_id"], claims["sub"], claims["client_id"]) == ("acme", "bob", "dev")


async def test_client_credentials_by_post_defaults_tenant_and_honours_resource(
    issuer: Issuer, client: httpx.AsyncClient
) -> None:
    form = {"grant_type": "client_credentials", "client_id": "dev", "client_secret": "dev", "resource": "https://x/mcp"}
    response = await client.post(f"{issuer.url}/token", data=form)
    assert response.status_code == 200
    claims = await verify(client, issuer, response.json()["access_token"], audience="https://x/mcp")
    assert (claims["tenant_id"], claims["sub"]) == ("dev-tenant", "dev-user")


async def test_request_token_helper_gets_a_token_from_the_running_issuer(
    issuer: Issuer, client: httpx.AsyncClient
) -> None:
    token = await asyncio.to_thread(
        request_token, issuer.url, tenant="t1", subject="carol", scope="tasks", resource=None
    )
    claims = await verify(client, issuer, token)
    assert (claims["tenant_id"], claims["sub"]) == ("t1", "carol")


def test_request_token_helper_says_how_to_start_an_unreachable_issuer() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match="mcp-tasks dev-issuer"):
        request_token(f"http://127.0.0.1:{port}", tenant="t", subject="s", scope="tasks", resource=None)


async def test_registration_authorize_and_token_exchange_give_a_token_for_the_resource(
    issuer: Issuer, client: httpx.AsyncClient
) -> None:
    registered = await register(client, issuer)
    assert registered["client_name"] == "test client"
    assert registered["redirect_uris"] == [REDIRECT]
    assert "client_secret" not in registered
    assert isinstance(registered["client_id_issued_at"], int)
    verifier = new_verifier()
    resource = "http://127.0.0.1:8000/mcp/other"
    code = await code_for(
        client, issuer, registered["client_id"], verifier, tenant="acme", login_hint="dave", resource=resource
    )
    response = await exchange(client, issuer, registered["client_id"], code, verifier, resource=resource)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["refresh_token"]
    claims = await verify(client, issuer, body["access_token"], audience=resource)
    assert (claims["tenant_id"], claims["sub"], claims["client_id"]) == ("acme", "dave", registered["client_id"])


async def test_confidential_client_gets_a_secret_and_the_default_audience(
    issuer: Issuer, client: httpx.AsyncClient
) -> None:
    registered = await register(client, issuer, token_endpoint_auth_method="client_secret_basic")
    assert registered["client_secret"]
    assert registered["client_secret_expires_at"] == 0
    verifier = new_verifier()
    code = await code_for(client, issuer, registered["client_id"], verifier)
    data = {"grant_type": "authorization_code", "code": code, "code_verifier": verifier, "redirect_uri": REDIRECT}
    response = await client.post(
        f"{issuer.url}/token", data=data, auth=(registered["client_id"], registered["client_secret"])
    )
    assert response.status_code == 200
    claims = await verify(client, issuer, response.json()["access_token"])
    assert (claims["tenant_id"], claims["sub"]) == ("dev-tenant", "dev-user")


async def test_wrong_code_verifier_is_invalid_grant(issuer: Issuer, client: httpx.AsyncClient) -> None:
    client_id = (await register(client, issuer))["client_id"]
    code = await code_for(client, issuer, client_id, new_verifier())
    response = await exchange(client, issuer, client_id, code, new_verifier())
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_grant"


async def test_a_code_works_once_and_its_replay_revokes_the_refresh_token(
    issuer: Issuer, client: httpx.AsyncClient
) -> None:
    client_id = (await register(client, issuer))["client_id"]
    verifier = new_verifier()
    code = await code_for(client, issuer, client_id, verifier)
    first = await exchange(client, issuer, client_id, code, verifier)
    assert first.status_code == 200
    replay = await exchange(client, issuer, client_id, code, verifier)
    assert replay.status_code == 400
    assert replay.json()["error"] == "invalid_grant"
    form = {"grant_type": "refresh_token", "client_id": client_id, "refresh_token": first.json()["refresh_token"]}
    refreshed = await client.post(f"{issuer.url}/token", data=form)
    assert refreshed.json()["error"] == "invalid_grant"


async def test_bad_client_secret_is_invalid_client_401(issuer: Issuer, client: httpx.AsyncClient) -> None:
    form = {"grant_type": "client_credentials"}
    basic = await client.post(f"{issuer.url}/token", data=form, auth=("dev", "wrong"))
    assert basic.status_code == 401
    assert basic.json()["error"] == "invalid_client"
    assert basic.headers["www-authenticate"].startswith("Basic")
    post = await client.post(f"{issuer.url}/token", data={**form, "client_id": "dev", "client_secret": "nope"})
    assert post.status_code == 401
    assert post.json()["error"] == "invalid_client"


async def test_refresh_token_grant_rotates_and_keeps_the_grant(issuer: Issuer, client: httpx.AsyncClient) -> None:
    client_id = (await register(client, issuer))["client_id"]
    verifier = new_verifier()
    code = await code_for(client, issuer, client_id, verifier, tenant="acme", login_hint="erin")
    old = (await exchange(client, issuer, client_id, code, verifier)).json()["refresh_token"]
    form = {"grant_type": "refresh_token", "client_id": client_id, "refresh_token": old}
    response = await client.post(f"{issuer.url}/token", data=form)
    assert response.status_code == 200
    body = response.json()
    assert body["refresh_token"] != old
    claims = await verify(client, issuer, body["access_token"])
    assert (claims["tenant_id"], claims["sub"], claims["scope"]) == ("acme", "erin", "tasks")
    reused = await client.post(f"{issuer.url}/token", data=form)
    assert reused.status_code == 400
    assert reused.json()["error"] == "invalid_grant"


@pytest.mark.parametrize(
    "pkce", [{}, {"code_challenge": "x" * 43}, {"code_challenge": "x" * 43, "code_challenge_method": "plain"}]
)
async def test_authorize_without_s256_pkce_redirects_with_invalid_request(
    issuer: Issuer, client: httpx.AsyncClient, pkce: dict[str, str]
) -> None:
    client_id = (await register(client, issuer))["client_id"]
    response = await authorize(client, issuer, client_id, **pkce)
    assert response.status_code == 302
    query = parse_qs(urlsplit(response.headers["location"]).query)
    assert query["error"] == ["invalid_request"]
    assert query["state"] == ["st"]
    assert "code" not in query


async def test_authorize_with_an_unregistered_redirect_uri_is_400_without_redirect(
    issuer: Issuer, client: httpx.AsyncClient
) -> None:
    client_id = (await register(client, issuer))["client_id"]
    challenge = {"code_challenge": create_s256_code_challenge(new_verifier()), "code_challenge_method": "S256"}
    response = await authorize(client, issuer, client_id, redirect_uri="https://evil.example/cb", **challenge)
    assert response.status_code == 400
    assert "location" not in response.headers
    unknown = await authorize(client, issuer, "no-such-client", **challenge)
    assert unknown.status_code == 400


async def test_loopback_redirect_uri_may_use_any_port(issuer: Issuer, client: httpx.AsyncClient) -> None:
    client_id = (await register(client, issuer))["client_id"]
    challenge = {"code_challenge": create_s256_code_challenge(new_verifier()), "code_challenge_method": "S256"}
    response = await authorize(client, issuer, client_id, redirect_uri="http://127.0.0.1:5555/callback", **challenge)
    assert response.status_code == 302
    assert response.headers["location"].startswith("http://127.0.0.1:5555/callback?code=")


@pytest.mark.parametrize(
    "metadata",
    [
        {"redirect_uris": []},
        {"redirect_uris": ["http://example.com/cb"]},
        {"redirect_uris": ["https://example.com/cb#frag"]},
        {"token_endpoint_auth_method": "private_key_jwt"},
        {"grant_types": ["password"]},
        {"scope": "admin"},
    ],
)
async def test_registration_refuses_unusable_metadata(
    issuer: Issuer, client: httpx.AsyncClient, metadata: dict[str, Any]
) -> None:
    body = {"redirect_uris": [REDIRECT], **metadata}
    response = await client.post(f"{issuer.url}/register", json=body)
    assert response.status_code == 400
    assert response.json()["error"] in {"invalid_redirect_uri", "invalid_client_metadata", "invalid_scope"}


async def test_unknown_scope_and_grant_type_are_refused(issuer: Issuer, client: httpx.AsyncClient) -> None:
    scope = await client.post(
        f"{issuer.url}/token", data={"grant_type": "client_credentials", "scope": "admin"}, auth=("dev", "dev")
    )
    assert (scope.status_code, scope.json()["error"]) == (400, "invalid_scope")
    grant = await client.post(f"{issuer.url}/token", data={"grant_type": "password"}, auth=("dev", "dev"))
    assert (grant.status_code, grant.json()["error"]) == (400, "unsupported_grant_type")


async def test_signing_key_is_persisted_private_and_reused_by_the_next_instance(
    tmp_path: Path, client: httpx.AsyncClient
) -> None:
    key_path = tmp_path / "dev-issuer.jwk"
    async with serve_issuer(key_path) as first:
        first_jwks = (await client.get(f"{first.url}/jwks")).json()
        response = await client.post(
            f"{first.url}/token", data={"grant_type": "client_credentials"}, auth=("dev", "dev")
        )
        token = response.json()["access_token"]
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert "d" in key_path.read_text()
    async with serve_issuer(key_path) as second:
        assert (await client.get(f"{second.url}/jwks")).json() == first_jwks
        keys = KeySet.import_key_set((await client.get(f"{second.url}/jwks")).json())
        assert jwt.decode(token, keys, algorithms=["ES256"]).claims["client_id"] == "dev"
    assert first_jwks["keys"][0]["kid"] == load_or_create_signing_key(key_path).thumbprint()
    assert "d" not in first_jwks["keys"][0]


async def test_startup_warns_and_no_token_or_secret_reaches_the_log(
    tmp_path: Path, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with serve_issuer() as issuer:
        registered = await register(client, issuer, token_endpoint_auth_method="client_secret_post")
        verifier = new_verifier()
        code = await code_for(client, issuer, registered["client_id"], verifier)
        body = (
            await exchange(
                client, issuer, registered["client_id"], code, verifier, client_secret=registered["client_secret"]
            )
        ).json()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "development only" in r.getMessage()]
    assert warnings
    # Only the issuer's own records: the test's HTTP client logs the redirect URL, code included.
    logged = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(("httpx", "httpcore")))
    for secret in (registered["client_secret"], code, verifier, body["access_token"], body["refresh_token"]):
        assert secret not in logged


async def test_only_loopback_pages_may_call_the_dev_issuer_from_a_browser(
    issuer: Issuer, client: httpx.AsyncClient
) -> None:
    """Security review, point 8: with the well-known dev/dev client, CORS * let any page mint tokens."""
    local = await client.get(f"{issuer.url}/jwks", headers={"Origin": "http://localhost:6274"})
    assert local.headers["access-control-allow-origin"] == "http://localhost:6274"
    evil = await client.get(f"{issuer.url}/jwks", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in evil.headers
    preflight = await client.options(
        f"{issuer.url}/token",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers


async def test_the_dev_issuer_refuses_a_rebound_host(issuer: Issuer, client: httpx.AsyncClient) -> None:
    """DNS rebinding: a page whose name resolves to 127.0.0.1 still sends its own Host."""
    rebound = await client.get(f"{issuer.url}/jwks", headers={"Host": "evil.example"})
    assert rebound.status_code == 403
    assert (await client.get(f"{issuer.url}/jwks")).status_code == 200
