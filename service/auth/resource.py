"""Hosted mode: the OAuth 2.1 resource server (RFC 6750 challenges, RFC 9728 metadata)."""

from __future__ import annotations

import logging
from typing import Any, Final
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

from service.auth.base import AuthFailure
from service.auth.tokens import IssuerUnavailable, TokenRejected, TokenVerifier, fingerprint
from service.config import Settings
from service.domain.principal import Principal

log = logging.getLogger(__name__)

PRM_PATH: Final = "/.well-known/oauth-protected-resource"
DEFAULT_SCOPES: Final = ("tasks",)


def metadata_url(settings: Settings) -> str:
    """A-PRM-4: the path-inserted well-known URL of our protected resource metadata."""
    parts = urlsplit(settings.effective_public_url)
    return f"{parts.scheme}://{parts.netloc}{PRM_PATH}{parts.path.rstrip('/')}"


def protected_resource_metadata(settings: Settings) -> dict[str, Any]:
    """A-PRM-2/5/6: resource = the canonical URL clients derived the metadata URL from."""
    scopes = sorted(settings.required_scopes) or list(DEFAULT_SCOPES)
    return {
        "resource": settings.effective_public_url,
        "authorization_servers": settings.trusted_issuers,
        "scopes_supported": scopes,
        "bearer_methods_supported": ["header"],
        "resource_name": "mcp-task-service",
    }


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


class OAuthResourceServer:
    """Authenticates every request to the MCP endpoint from its bearer token (A-TOK-2)."""

    def __init__(self, settings: Settings, verifier: TokenVerifier) -> None:
        self.settings = settings
        self.verifier = verifier
        self._metadata_url = metadata_url(settings)
        self._scope = " ".join(sorted(settings.required_scopes) or DEFAULT_SCOPES)
        self._required_scopes = settings.required_scopes

    def _challenge(
        self,
        status: int,
        error: str | None,
        description: str,
        *,
        reason: str | None = None,
        principal: Principal | None = None,
        detail: dict[str, str] | None = None,
    ) -> AuthFailure:
        parts = [f'resource_metadata="{self._metadata_url}"']
        if error:
            parts.append(f'error="{error}"')
            parts.append(f'error_description="{_quote(description)}"')
        parts.append(f'scope="{self._scope}"')
        headers = {"WWW-Authenticate": "Bearer " + ", ".join(parts)}
        return AuthFailure(
            status,
            error or "unauthorized",
            description,
            headers,
            reason=reason or error or "no_token",
            principal=principal,
            detail=detail,
        )

    def challenge_headers(self) -> dict[str, str]:
        return self._challenge(401, None, "").headers

    def known(self, conn: HTTPConnection) -> Principal | None:
        """The principal of a token verified before, still valid and with the required scopes:
        what ``authenticate`` would answer, found without its work (the hot path). Anything else
        (no token, a token in the URL, an unknown or insufficient one) is None: ``authenticate``
        then refuses it with its reason."""
        if conn.scope.get("query_string"):
            return None
        scheme, _, token = (conn.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        principal = self.verifier.cached(token.strip())
        if principal is None or not self._required_scopes <= principal.scopes:
            return None
        return principal

    async def authenticate(self, conn: HTTPConnection) -> Principal:
        client = conn.client.host if conn.client else "-"
        # The query string is parsed only when there is one (a request has none, as a rule).
        if conn.scope.get("query_string") and "access_token" in conn.query_params:
            self._log_denied("query_token", client, None)
            raise self._challenge(
                401, "invalid_request", "access tokens in the URL are not accepted; send Authorization: Bearer"
            )
        header = conn.headers.get("authorization")
        if not header:
            raise self._challenge(401, None, "authentication required: send Authorization: Bearer <token>")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or " " in token:
            self._log_denied("malformed_header", client, None)
            raise self._challenge(
                401, "invalid_token", "the Authorization header must be 'Bearer <token>'", reason="malformed_header"
            )
        try:
            principal = await self.verifier.verify(token)
        except TokenRejected as exc:
            self._log_denied(exc.reason, client, token)
            raise self._challenge(401, "invalid_token", exc.description, reason=exc.reason, detail=exc.detail) from None
        except IssuerUnavailable as exc:
            log.warning("auth unavailable: %s", exc)
            raise AuthFailure(
                503,
                "temporarily_unavailable",
                "the authorization server's keys cannot be fetched right now; retry shortly",
                {"Retry-After": "5"},
                reason="issuer_unavailable",
            ) from None
        missing = self._required_scopes - principal.scopes
        if missing:
            self._log_denied("insufficient_scope", client, token, principal)
            raise self._challenge(
                403, "insufficient_scope", f"the token lacks scope(s): {' '.join(sorted(missing))}",
                reason="insufficient_scope",
                principal=principal,
            )  # fmt: skip
        return principal

    @staticmethod
    def _log_denied(reason: str, client: str, token: str | None, principal: Principal | None = None) -> None:
        who = f" tenant={principal.tenant_id} sub={principal.subject}" if principal else ""
        handle = f" token={fingerprint(token)}" if token else ""
        log.warning("auth denied reason=%s client=%s%s%s", reason, client, who, handle)
