"""The dev issuer's client-facing endpoints: dynamic registration and the auto-approving PKCE authorize page."""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from typing import Final
from urllib.parse import urlencode, urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from service.auth.dev_issuer_records import (
    AUTH_METHODS,
    GRANT_TYPES,
    NO_STORE,
    AuthorizationCode,
    Client,
    IssuerState,
    OAuthError,
    check_scope,
    client_scopes,
    one_resource,
)
from service.auth.dev_keys import DevIssuerConfig
from service.config import is_loopback_host

# One logger name for the whole dev issuer, whichever of its modules writes the line.
log = logging.getLogger("service.auth.dev_issuer")

CODE_TTL_S: Final = 60
# RFC 7636 §4.2: an S256 challenge is 43 base64url characters.
_S256_CHALLENGE = re.compile(r"[A-Za-z0-9_-]{43}")
_ISSUED_FIELDS = frozenset({"client_id", "client_secret", "client_id_issued_at", "client_secret_expires_at"})
_UNSAFE_SCHEMES = frozenset({"javascript", "data", "file", "vbscript", "about", "blob"})


class ClientEndpoints:
    """POST /register and GET /authorize over the issuer's in-memory clients and codes."""

    def __init__(self, config: DevIssuerConfig, state: IssuerState) -> None:
        self.config = config
        self.state = state

    async def register(self, request: Request) -> Response:
        try:
            meta = json.loads(await request.body())
        except ValueError:
            meta = None
        if not isinstance(meta, dict):
            raise OAuthError("invalid_client_metadata", "the body must be a JSON object")
        method = meta.get("token_endpoint_auth_method", "client_secret_basic")
        grants = meta.get("grant_types", ["authorization_code"])
        if method not in AUTH_METHODS:
            raise OAuthError("invalid_client_metadata", f"token_endpoint_auth_method must be one of {AUTH_METHODS}")
        if not _str_list(grants) or not set(grants) <= set(GRANT_TYPES):
            raise OAuthError("invalid_client_metadata", f"grant_types must be a subset of {GRANT_TYPES}")
        if "client_credentials" in grants and method == "none":
            raise OAuthError("invalid_client_metadata", "client_credentials needs a confidential client")
        uris = meta.get("redirect_uris", [])
        if "authorization_code" in grants and not (_str_list(uris) and uris):
            raise OAuthError("invalid_redirect_uri", "redirect_uris is required for authorization_code")
        if not _str_list(uris) or not all(_valid_redirect_uri(u) for u in uris):
            raise OAuthError("invalid_redirect_uri", "redirect URIs must be https, loopback http or a private scheme")
        scope = meta.get("scope")
        if scope is not None and not isinstance(scope, str):
            raise OAuthError("invalid_client_metadata", "scope must be a string")
        if scope is not None:
            check_scope(scope, self.config.scopes_supported)
        client = Client(
            secrets.token_urlsafe(16),
            None if method == "none" else secrets.token_urlsafe(32),
            tuple(uris),
            tuple(grants),
            scope,
        )
        self.state.clients[client.client_id] = client
        log.info("dev issuer registered client %s (%s)", client.client_id, method)
        answer = {
            **{k: v for k, v in meta.items() if k not in _ISSUED_FIELDS},
            "client_id": client.client_id,
            "client_id_issued_at": int(time.time()),
            "token_endpoint_auth_method": method,
            "grant_types": list(grants),
            "response_types": meta.get("response_types", ["code"]),
            "redirect_uris": list(uris),
        }
        if client.secret is not None:
            answer |= {"client_secret": client.secret, "client_secret_expires_at": 0}
        return JSONResponse(answer, 201, headers=NO_STORE)

    async def authorize(self, request: Request) -> Response:
        """Auto-approves: there is no login page; `tenant` and `login_hint` pick the principal."""
        query = request.query_params
        client = self.state.clients.get(query.get("client_id", ""))
        if client is None:
            raise OAuthError("invalid_request", "unknown client_id")
        given = query.get("redirect_uri")
        if given is None and len(client.redirect_uris) != 1:
            raise OAuthError("invalid_request", "redirect_uri is required")
        redirect_uri = given or client.redirect_uris[0]
        if not any(_redirect_matches(r, redirect_uri) for r in client.redirect_uris):
            raise OAuthError("invalid_request", "redirect_uri is not registered for this client")
        state = query.get("state")
        # From here on errors go back to the client's redirect URI (RFC 6749 §4.1.2.1).
        try:
            if query.get("response_type") != "code":
                raise OAuthError("unsupported_response_type", "response_type must be code")
            if "authorization_code" not in client.grant_types:
                raise OAuthError("unauthorized_client", "client is not registered for authorization_code")
            if query.get("code_challenge_method") != "S256":
                raise OAuthError("invalid_request", "PKCE with code_challenge_method=S256 is required")
            challenge = query.get("code_challenge", "")
            if not _S256_CHALLENGE.fullmatch(challenge):
                raise OAuthError("invalid_request", "code_challenge must be a base64url SHA-256 digest")
            scope = check_scope(query.get("scope"), client_scopes(client, self.config.scopes_supported))
            resource = one_resource(query.getlist("resource"))
        except OAuthError as exc:
            return _redirect(redirect_uri, error=exc.error, error_description=exc.description, state=state)
        now = time.monotonic()
        self.state.prune(now)
        code = secrets.token_urlsafe(32)
        self.state.codes[code] = AuthorizationCode(
            client.client_id,
            given,
            challenge,
            query.get("tenant") or self.config.default_tenant,
            query.get("login_hint") or self.config.default_subject,
            scope,
            resource,
            now + CODE_TTL_S,
        )
        return _redirect(redirect_uri, code=code, state=state, iss=self.config.issuer)


def _valid_redirect_uri(uri: str) -> bool:
    """https, http on a loopback host, or a private-use scheme (RFC 8252 §7.1); never a fragment."""
    parts = urlsplit(uri)
    if not parts.scheme or "#" in uri or parts.scheme in _UNSAFE_SCHEMES:
        return False
    if parts.scheme == "http":
        return is_loopback_host(parts.hostname or "")
    return parts.scheme != "https" or bool(parts.netloc)


def _redirect_matches(registered: str, given: str) -> bool:
    """Exact match, except that loopback http redirect URIs may use any port (RFC 8252 §7.3)."""
    if registered == given:
        return True
    a, b = urlsplit(registered), urlsplit(given)
    loopback = a.scheme == b.scheme == "http" and is_loopback_host(a.hostname or "")
    return loopback and (a.hostname, a.path, a.query) == (b.hostname, b.path, b.query)


def _redirect(uri: str, **params: str | None) -> Response:
    query = urlencode({k: v for k, v in params.items() if v is not None})
    separator = "&" if urlsplit(uri).query else "?"
    return RedirectResponse(f"{uri}{separator}{query}", 302, headers=NO_STORE)


def _str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
