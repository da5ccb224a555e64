"""The dev issuer's token endpoint: client authentication and the code, client-credentials and refresh grants."""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import re
import secrets
import time
from typing import Any, Final
from urllib.parse import parse_qsl, unquote_plus

from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc.jwk import ECKey
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.auth.dev_issuer_records import (
    GRANT_TYPES,
    NO_STORE,
    Client,
    Grant,
    IssuerState,
    OAuthError,
    check_scope,
    client_scopes,
    one_resource,
)
from service.auth.dev_keys import DevIssuerConfig, mint_access_token

# One logger name for the whole dev issuer, whichever of its modules writes the line.
log = logging.getLogger("service.auth.dev_issuer")

REFRESH_TTL_S: Final = 86_400
MAX_FORM_BYTES: Final = 65_536
# RFC 7636 §4.1: a verifier is 43-128 unreserved characters.
_VERIFIER = re.compile(r"[A-Za-z0-9\-._~]{43,128}")


class TokenEndpoint:
    """POST /token over the issuer's in-memory clients, codes and refresh tokens."""

    def __init__(self, config: DevIssuerConfig, key: ECKey, state: IssuerState) -> None:
        self.config = config
        self.key = key
        self.state = state

    async def token(self, request: Request) -> Response:
        form = await _read_form(request)
        client = self._authenticate(request, form)
        grant_type = form.get("grant_type")
        self.state.prune(time.monotonic())
        if grant_type == "authorization_code":
            return self._exchange_code(client, form)
        if grant_type == "client_credentials":
            return self._client_credentials(client, form)
        if grant_type == "refresh_token":
            return self._refresh(client, form)
        if grant_type is None:
            raise OAuthError("invalid_request", "grant_type is required")
        raise OAuthError("unsupported_grant_type", f"grant_type must be one of {GRANT_TYPES}")

    def _exchange_code(self, client: Client, form: dict[str, str]) -> Response:
        code = self.state.codes.get(form.get("code", ""))
        verifier = form.get("code_verifier")
        if verifier is None:
            raise OAuthError("invalid_request", "code_verifier is required")
        if code is None or code.client_id != client.client_id:
            raise OAuthError("invalid_grant", "unknown or expired code")
        if code.used:
            # A replayed code may be stolen: revoke what it was exchanged for.
            self.state.refresh.pop(code.refresh_token or "", None)
            raise OAuthError("invalid_grant", "code already used")
        code.used = True
        if form.get("redirect_uri") != code.redirect_uri:
            raise OAuthError("invalid_grant", "redirect_uri differs from the authorization request")
        expected = str(create_s256_code_challenge(verifier))
        if not _VERIFIER.fullmatch(verifier) or not hmac.compare_digest(expected, code.challenge):
            raise OAuthError("invalid_grant", "code_verifier does not match the code_challenge")
        resource = one_resource([form["resource"]] if "resource" in form else [])
        if code.resource and resource and resource != code.resource:
            raise OAuthError("invalid_target", "resource differs from the authorization request")
        grant = Grant(
            client.client_id,
            code.tenant,
            code.subject,
            code.scope,
            resource or code.resource or self.config.audience,
            time.monotonic() + REFRESH_TTL_S,
        )
        answer = self._issue(grant, with_refresh="refresh_token" in client.grant_types)
        code.refresh_token = answer.get("refresh_token")
        return JSONResponse(answer, headers=NO_STORE)

    def _client_credentials(self, client: Client, form: dict[str, str]) -> Response:
        if client.secret is None or "client_credentials" not in client.grant_types:
            raise OAuthError("unauthorized_client", "client is not registered for client_credentials")
        resource = one_resource([form["resource"]] if "resource" in form else [])
        grant = Grant(
            client.client_id,
            form.get("tenant") or self.config.default_tenant,
            form.get("subject") or self.config.default_subject,
            check_scope(form.get("scope"), client_scopes(client, self.config.scopes_supported)),
            resource or self.config.audience,
            0.0,
        )
        return JSONResponse(self._issue(grant, with_refresh=False), headers=NO_STORE)

    def _refresh(self, client: Client, form: dict[str, str]) -> Response:
        old = self.state.refresh.get(form.get("refresh_token", ""))
        if old is None or old.client_id != client.client_id:
            raise OAuthError("invalid_grant", "unknown or expired refresh_token")
        resource = one_resource([form["resource"]] if "resource" in form else [])
        if resource and resource != old.audience:
            raise OAuthError("invalid_target", "resource differs from the original grant")
        scope = check_scope(form.get("scope") or old.scope, tuple(old.scope.split()))
        del self.state.refresh[form["refresh_token"]]  # rotated (OAuth 2.1 §4.3.1)
        grant = Grant(old.client_id, old.tenant, old.subject, scope, old.audience, old.expires_at)
        return JSONResponse(self._issue(grant, with_refresh=True), headers=NO_STORE)

    def _issue(self, grant: Grant, *, with_refresh: bool) -> dict[str, Any]:
        token = mint_access_token(
            self.key,
            self.config,
            tenant=grant.tenant,
            subject=grant.subject,
            client_id=grant.client_id,
            scope=grant.scope,
            audience=grant.audience,
        )
        answer: dict[str, Any] = {
            "access_token": token,
            "token_type": "Bearer",
            "expires_in": self.config.token_ttl_s,
            "scope": grant.scope,
        }
        if with_refresh:
            refresh = secrets.token_urlsafe(32)
            self.state.refresh[refresh] = grant
            answer["refresh_token"] = refresh
        log.info(
            "dev issuer issued a token to client %s for tenant %s, subject %s, audience %s",
            grant.client_id,
            grant.tenant,
            grant.subject,
            grant.audience,
        )
        return answer

    def _authenticate(self, request: Request, form: dict[str, str]) -> Client:
        """client_secret_basic, client_secret_post, or a public client naming itself (RFC 6749 §2.3)."""
        basic = _basic_credentials(request.headers.get("authorization"))
        if basic is not None and ("client_secret" in form or form.get("client_id", basic[0]) != basic[0]):
            raise OAuthError("invalid_request", "use one client authentication method")
        client_id, secret = basic or (form.get("client_id"), form.get("client_secret"))
        challenge = {"WWW-Authenticate": 'Basic realm="dev-issuer"'} if basic else {}
        client = self.state.clients.get(client_id or "")
        if client is None:
            raise OAuthError("invalid_client", "unknown client", 401, challenge)
        if client.secret is None:
            if secret is not None:
                raise OAuthError("invalid_client", "public clients have no secret", 401, challenge)
        elif secret is None or not hmac.compare_digest(secret.encode(), client.secret.encode()):
            raise OAuthError("invalid_client", "client authentication failed", 401, challenge)
        return client


async def _read_form(request: Request) -> dict[str, str]:
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        raise OAuthError("invalid_request", "the body must be application/x-www-form-urlencoded")
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise OAuthError("invalid_request", "request body too large")
    try:
        pairs = parse_qsl(body.decode(), keep_blank_values=False, strict_parsing=bool(body))
    except (UnicodeDecodeError, ValueError) as exc:
        raise OAuthError("invalid_request", "malformed form body") from exc
    form = dict(pairs)
    if len(form) != len(pairs):
        raise OAuthError("invalid_request", "parameters must not be repeated")  # RFC 6749 §3.2
    return form


def _basic_credentials(header: str | None) -> tuple[str, str] | None:
    if not header or not header.lower().startswith("basic "):
        return None
    try:
        user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise OAuthError("invalid_client", "malformed Basic credentials", 401) from exc
    if not sep:
        raise OAuthError("invalid_client", "malformed Basic credentials", 401)
    return unquote_plus(user), unquote_plus(password)  # RFC 6749 §2.3.1 form-encodes both
