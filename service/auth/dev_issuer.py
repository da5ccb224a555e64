"""A development-only OAuth 2.1 authorization server that mints ES256 JWT access tokens (RFC 9068)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Final
from urllib.parse import urlsplit

from joserfc.jwk import ECKey
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.auth.dev_issuer_clients import ClientEndpoints
from service.auth.dev_issuer_records import (
    AUTH_METHODS,
    DEV_CLIENT_ID,
    DEV_CLIENT_SECRET,
    GRANT_TYPES,
    NO_STORE,
    Client,
    IssuerState,
    OAuthError,
)
from service.auth.dev_issuer_token import TokenEndpoint
from service.auth.dev_keys import DevIssuerConfig, load_or_create_signing_key

log = logging.getLogger(__name__)

DEV_HEADER: Final = "X-Dev-Issuer"
DEV_HEADER_VALUE: Final = "development only - never use in production"


def create_dev_issuer_app(config: DevIssuerConfig) -> Starlette:
    """The dev issuer as an ASGI app: metadata, JWKS, registration, authorize, token."""
    parts = urlsplit(config.issuer)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"issuer must be an http(s) URL without query or fragment, not {config.issuer!r}")
    config = replace(config, issuer=config.issuer.rstrip("/"))
    base = parts.path.rstrip("/")
    key = load_or_create_signing_key(config.key_path)
    state = IssuerState()
    state.clients[DEV_CLIENT_ID] = Client(DEV_CLIENT_ID, DEV_CLIENT_SECRET, (), ("client_credentials",), None)
    discovery = _Discovery(config, key)
    clients = ClientEndpoints(config, state)
    tokens = TokenEndpoint(config, key, state)
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
            *(Route(path, discovery.metadata, methods=["GET"]) for path in metadata_routes),
            Route(f"{base}/jwks", discovery.jwks, methods=["GET"]),
            Route(f"{base}/register", clients.register, methods=["POST"]),
            Route(f"{base}/authorize", clients.authorize, methods=["GET"]),
            Route(f"{base}/token", tokens.token, methods=["POST"]),
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


class _Discovery:
    """The authorization server metadata (RFC 8414) and the public signing key (JWKS)."""

    def __init__(self, config: DevIssuerConfig, key: ECKey) -> None:
        self.config = config
        self.key = key

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
