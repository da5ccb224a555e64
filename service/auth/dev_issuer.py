"""A development-only OAuth 2.1 authorization server that mints ES256 JWT access tokens (RFC 9068)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final
from urllib.parse import parse_qsl, unquote_plus, urlencode, urlsplit

from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc.jwk import ECKey
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.auth.dev_keys import DevIssuerConfig, load_or_create_signing_key, mint_access_token
from service.config import is_loopback_host

log = logging.getLogger(__name__)

DEV_HEADER: Final = "X-Dev-Issuer"
DEV_HEADER_VALUE: Final = "development only - never use in production"
DEV_CLIENT_ID: Final = "dev"
DEV_CLIENT_SECRET: Final = "dev"  # noqa: S105 - the well-known secret of the built-in dev client
CODE_TTL_S: Final = 60
REFRESH_TTL_S: Final = 86_400
MAX_FORM_BYTES: Final = 65_536
GRANT_TYPES: Final = ("authorization_code", "client_credentials", "refresh_token")
AUTH_METHODS: Final = ("client_secret_post", "client_secret_basic", "none")
NO_STORE: Final = {"Cache-Control": "no-store", "Pragma": "no-cache"}
# RFC 7636 §4.1/§4.2: a verifier is 43-128 unreserved characters; an S256 challenge is 43 base64url ones.
_VERIFIER = re.compile(r"[A-Za-z0-9\-._~]{43,128}")
_S256_CHALLENGE = re.compile(r"[A-Za-z0-9_-]{43}")
_ISSUED_FIELDS = frozenset({"client_id", "client_secret", "client_id_issued_at", "client_secret_expires_at"})
_UNSAFE_SCHEMES = frozenset({"javascript", "data", "file", "vbscript", "about", "blob"})


@dataclass(frozen=True)
class _Client:
    client_id: str
    secret: str | None
    redirect_uris: tuple[str, ...]
    grant_types: tuple[str, ...]
    scope: str | None


@dataclass
class _Code:
    client_id: str
    redirect_uri: str | None  # as sent to /authorize; the token request must repeat it
    challenge: str
    tenant: str
    subject: str
    scope: str
    resource: str | None
    expires_at: float
    used: bool = False
    refresh_token: str | None = None  # revoked if the code is replayed (RFC 6749 §4.1.2)


@dataclass(frozen=True)
class _Grant:
    client_id: str
    tenant: str
    subject: str
    scope: str
    audience: str
    expires_at: float


@dataclass
class _State:
    clients: dict[str, _Client] = field(default_factory=dict)
    codes: dict[str, _Code] = field(default_factory=dict)
    refresh: dict[str, _Grant] = field(default_factory=dict)

    def prune(self, now: float) -> None:
        self.codes = {k: c for k, c in self.codes.items() if c.expires_at > now}
        self.refresh = {k: g for k, g in self.refresh.items() if g.expires_at > now}


class OAuthError(Exception):
    """An RFC 6749 §5.2 error; `status` is 400, or 401 for a client that failed to authenticate."""

    def __init__(self, error: str, description: str, status: int = 400, headers: Mapping[str, str] | None = None):
        super().__init__(description)
        self.error = error
        self.description = description
        self.status = status
        self.headers = dict(headers or {})


def create_dev_issuer_app(config: DevIssuerConfig) -> Starlette:
    """The dev issuer as an ASGI app: metadata, JWKS, registration, authorize, token."""
    parts = urlsplit(config.issuer)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"issuer must be an http(s) URL without query or fragment, not {config.issuer!r}")
    config = replace(config, issuer=config.issuer.rstrip("/"))
    base = parts.path.rstrip("/")
    key = load_or_create_signing_key(config.key_path)
    issuer = _Issuer(config, key)
    metadata_routes = [
        f"/.well-known/oauth-authorization-server{base}",
        f"/.well-known/openid-configuration{base}",
        *([f"{base}/.well-known/openid-configuration"] if base else []),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        log.warning("DEV ISSUER at %s: %s; it hands any tenant a token", config.issuer, DEV_HEADER_VALUE)
        yield

    return Starlette(
        routes=[
            *(Route(path, issuer.metadata, methods=["GET"]) for path in metadata_routes),
            Route(f"{base}/jwks", issuer.jwks, methods=["GET"]),
            Route(f"{base}/register", issuer.register, methods=["POST"]),
            Route(f"{base}/authorize", issuer.authorize, methods=["GET"]),
            Route(f"{base}/token", issuer.token, methods=["POST"]),
        ],
        middleware=[
            Middleware(_DevHeader),
            # DNS rebinding: a page served from elsewhere that resolves its name to 127.0.0.1 still
            # sends its own Host.
            Middleware(_LoopbackHost),
            # Browser-based MCP clients on this machine (e.g. the MCP Inspector) fetch metadata and
            # tokens cross-origin; pages of any other origin may not (the dev client mints tokens
            # for any tenant).
            Middleware(
                CORSMiddleware, allow_origin_regex=LOOPBACK_ORIGIN, allow_methods=["GET", "POST"], allow_headers=["*"]
            ),
        ],
        exception_handlers={OAuthError: _oauth_error, Exception: _internal_error},
        lifespan=lifespan,
    )


LOOPBACK_ORIGIN = r"https?://(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?"
_LOOPBACK_HOST = re.compile(r"(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?")


class _LoopbackHost:
    """Refuses a request whose Host is not a loopback name (403)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host", "")
            if not _LOOPBACK_HOST.fullmatch(host.lower()):
                response = JSONResponse({"error": "invalid_request", "error_description": "Host is not loopback"}, 403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _DevHeader:
    """Marks every response as coming from a development-only issuer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-dev-issuer", DEV_HEADER_VALUE.encode())]
            await send(message)

        await self.app(scope, receive, marked if scope["type"] == "http" else send)


async def _oauth_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OAuthError)
    body = {"error": exc.error, "error_description": exc.description}
    return JSONResponse(body, exc.status, headers={**NO_STORE, **exc.headers})


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Runs outside the middleware stack, so the dev header is added here.
    log.error("dev issuer: unexpected %s", type(exc).__name__)
    return JSONResponse({"error": "server_error"}, 500, headers={**NO_STORE, DEV_HEADER: DEV_HEADER_VALUE})


class _Issuer:
    """The endpoints, over in-memory clients, codes and refresh tokens."""

    def __init__(self, config: DevIssuerConfig, key: ECKey) -> None:
        self.config = config
        self.key = key
        self.state = _State()
        self.state.clients[DEV_CLIENT_ID] = _Client(DEV_CLIENT_ID, DEV_CLIENT_SECRET, (), ("client_credentials",), None)

    async def metadata(self, request: Request) -> Response:
        iss = self.config.issuer
        return JSONResponse(
            {
                "issuer": iss,
                "authorization_endpoint": f"{iss}/authorize",
                "token_endpoint": f"{iss}/token",
                "registration_endpoint": f"{iss}/register",
                "jwks_uri": f"{iss}/jwks",
                "response_types_supported": ["code"],
                "response_modes_supported": ["query"],
                "grant_types_supported": list(GRANT_TYPES),
                "code_challenge_methods_supported": ["S256"],
                "token_endpoint_auth_methods_supported": list(AUTH_METHODS),
                "scopes_supported": list(self.config.scopes_supported),
                "authorization_response_iss_parameter_supported": True,
            }
        )

    async def jwks(self, request: Request) -> Response:
        return JSONResponse({"keys": [self.key.as_dict(private=False)]})

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
            self._check_scope(scope, self.config.scopes_supported)
        client = _Client(
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
            scope = self._check_scope(query.get("scope"), self._client_scopes(client))
            resource = _one_resource(query.getlist("resource"))
        except OAuthError as exc:
            return _redirect(redirect_uri, error=exc.error, error_description=exc.description, state=state)
        now = time.monotonic()
        self.state.prune(now)
        code = secrets.token_urlsafe(32)
        self.state.codes[code] = _Code(
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

    def _exchange_code(self, client: _Client, form: dict[str, str]) -> Response:
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
        resource = _one_resource([form["resource"]] if "resource" in form else [])
        if code.resource and resource and resource != code.resource:
            raise OAuthError("invalid_target", "resource differs from the authorization request")
        grant = _Grant(
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

    def _client_credentials(self, client: _Client, form: dict[str, str]) -> Response:
        if client.secret is None or "client_credentials" not in client.grant_types:
            raise OAuthError("unauthorized_client", "client is not registered for client_credentials")
        resource = _one_resource([form["resource"]] if "resource" in form else [])
        grant = _Grant(
            client.client_id,
            form.get("tenant") or self.config.default_tenant,
            form.get("subject") or self.config.default_subject,
            self._check_scope(form.get("scope"), self._client_scopes(client)),
            resource or self.config.audience,
            0.0,
        )
        return JSONResponse(self._issue(grant, with_refresh=False), headers=NO_STORE)

    def _refresh(self, client: _Client, form: dict[str, str]) -> Response:
        old = self.state.refresh.get(form.get("refresh_token", ""))
        if old is None or old.client_id != client.client_id:
            raise OAuthError("invalid_grant", "unknown or expired refresh_token")
        resource = _one_resource([form["resource"]] if "resource" in form else [])
        if resource and resource != old.audience:
            raise OAuthError("invalid_target", "resource differs from the original grant")
        scope = self._check_scope(form.get("scope") or old.scope, tuple(old.scope.split()))
        del self.state.refresh[form["refresh_token"]]  # rotated (OAuth 2.1 §4.3.1)
        grant = _Grant(old.client_id, old.tenant, old.subject, scope, old.audience, old.expires_at)
        return JSONResponse(self._issue(grant, with_refresh=True), headers=NO_STORE)

    def _issue(self, grant: _Grant, *, with_refresh: bool) -> dict[str, Any]:
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

    def _authenticate(self, request: Request, form: dict[str, str]) -> _Client:
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

    def _client_scopes(self, client: _Client) -> tuple[str, ...]:
        return tuple(client.scope.split()) if client.scope else self.config.scopes_supported

    @staticmethod
    def _check_scope(requested: str | None, allowed: tuple[str, ...]) -> str:
        """The requested scope if every part is allowed; all allowed scopes when none is requested."""
        wanted = requested.split(" ") if requested else list(allowed)
        if not wanted or not all(s in allowed for s in wanted):
            raise OAuthError("invalid_scope", f"scope must be drawn from {' '.join(allowed)!r}")
        return " ".join(dict.fromkeys(wanted))


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


def _one_resource(values: list[str]) -> str | None:
    """At most one RFC 8707 resource, an absolute URI without a fragment."""
    if not values:
        return None
    parts = urlsplit(values[0])
    if len(values) > 1 or not parts.scheme or not parts.netloc or parts.fragment or "#" in values[0]:
        raise OAuthError("invalid_target", "resource must be one absolute URI without a fragment")
    return values[0]


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
