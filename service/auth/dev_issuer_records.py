"""The dev issuer's in-memory records (clients, codes, refresh grants), its OAuth error and shared rules."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

DEV_CLIENT_ID: Final = "dev"
DEV_CLIENT_SECRET: Final = "dev"  # noqa: S105 - the well-known secret of the built-in dev client
GRANT_TYPES: Final = ("authorization_code", "client_credentials", "refresh_token")
AUTH_METHODS: Final = ("client_secret_post", "client_secret_basic", "none")
NO_STORE: Final = {"Cache-Control": "no-store", "Pragma": "no-cache"}


@dataclass(frozen=True)
class Client:
    client_id: str
    secret: str | None
    redirect_uris: tuple[str, ...]
    grant_types: tuple[str, ...]
    scope: str | None


@dataclass
class AuthorizationCode:
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
class Grant:
    client_id: str
    tenant: str
    subject: str
    scope: str
    audience: str
    expires_at: float


@dataclass
class IssuerState:
    clients: dict[str, Client] = field(default_factory=dict)
    codes: dict[str, AuthorizationCode] = field(default_factory=dict)
    refresh: dict[str, Grant] = field(default_factory=dict)

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


def client_scopes(client: Client, supported: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(client.scope.split()) if client.scope else supported


def check_scope(requested: str | None, allowed: tuple[str, ...]) -> str:
    """The requested scope if every part is allowed; all allowed scopes when none is requested."""
    wanted = requested.split(" ") if requested else list(allowed)
    if not wanted or not all(s in allowed for s in wanted):
        raise OAuthError("invalid_scope", f"scope must be drawn from {' '.join(allowed)!r}")
    return " ".join(dict.fromkeys(wanted))


def one_resource(values: list[str]) -> str | None:
    """At most one RFC 8707 resource, an absolute URI without a fragment."""
    if not values:
        return None
    parts = urlsplit(values[0])
    if len(values) > 1 or not parts.scheme or not parts.netloc or parts.fragment or "#" in values[0]:
        raise OAuthError("invalid_target", "resource must be one absolute URI without a fragment")
    return values[0]
