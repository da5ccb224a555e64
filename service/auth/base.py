"""The authenticator interface and the single-user (no auth) implementation."""

from __future__ import annotations

from typing import Any, Protocol

from starlette.requests import HTTPConnection

from service.config import Settings
from service.domain.principal import LOCAL_PRINCIPAL, Principal


class AuthFailure(Exception):
    """An HTTP-level refusal (401/403) with the challenge header to send."""

    def __init__(
        self,
        status: int,
        error: str,
        description: str,
        headers: dict[str, str],
        *,
        reason: str | None = None,
        principal: Principal | None = None,
        detail: dict[str, str] | None = None,
    ) -> None:
        super().__init__(description)
        self.status = status
        self.error = error
        self.description = description
        self.headers = headers
        self.reason = reason or error  # a short bounded label for audit rows and metrics
        self.principal = principal  # set when the token was valid but not enough (403)
        self.detail = detail or {}  # what the denial's audit row records besides the reason


class Authenticator(Protocol):
    async def authenticate(self, conn: HTTPConnection) -> Principal: ...

    def known(self, conn: HTTPConnection) -> Principal | None:
        """The request's principal when authenticating it costs nothing (a token verified before,
        still valid, enough for this endpoint); None: ``authenticate`` decides."""
        ...

    def challenge_headers(self) -> dict[str, str]:
        """What a refusal should carry so clients can still find the authorization server."""
        ...


class SingleUser:
    """MCP_TASKS_AUTH=none: every request is the one local principal (loopback binds only)."""

    async def authenticate(self, conn: HTTPConnection) -> Principal:
        return LOCAL_PRINCIPAL

    def known(self, conn: HTTPConnection) -> Principal | None:
        return LOCAL_PRINCIPAL

    def challenge_headers(self) -> dict[str, str]:
        return {}


def build_authenticator(settings: Settings, http: Any) -> Authenticator:
    """The authenticator the settings ask for: single-user, or the OAuth resource server."""
    if settings.effective_auth == "none":
        return SingleUser()
    from service.auth.resource import OAuthResourceServer
    from service.auth.tokens import TokenVerifier

    return OAuthResourceServer(settings, TokenVerifier(settings, http))
