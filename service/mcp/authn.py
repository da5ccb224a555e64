"""The second layer: who is asking. A token verified before costs nothing; any other request from
an address over its failed-authentication budget is refused before any token work (T-SEC-6)."""

from __future__ import annotations

import time

from starlette.datastructures import Headers
from starlette.types import Scope

from service.auth.base import Authenticator, AuthFailure
from service.domain.principal import Caller, Principal
from service.guard.ratelimit import RateLimiter
from service.mcp.http import RequestConnection, RequestHeaders, direct_exchange
from service.mcp.throttle import throttled
from service.observability import metrics
from service.tasks.audit import AuditLog


class Authentication:
    def __init__(self, authenticator: Authenticator, limiter: RateLimiter, audit: AuditLog) -> None:
        self.auth = authenticator
        self.limiter = limiter
        self.audit = audit

    async def principal(
        self, scope: Scope, connection: RequestConnection, headers: RequestHeaders, address: str, request_id: str
    ) -> Principal:
        """The request's principal, or AuthFailure (401/403 with its challenge) or a 429."""
        principal = self._known(scope, connection, headers)
        if principal is None:
            principal = await self._authenticate(connection, headers, address, request_id)
        return principal

    def _known(self, scope: Scope, connection: RequestConnection, headers: RequestHeaders) -> Principal | None:
        """``auth.known``, remembered per connection on our server: a keep-alive connection's
        requests carry one Authorization header as a rule, and the principal found for it holds
        for the same header until its token runs out, as in the verifier's cache. The header is
        compared whole, so another token on the same connection (a proxy's) is looked up anew;
        the memo goes with the connection."""
        direct = direct_exchange(scope)
        header = headers.raw_value(b"authorization")
        if direct is None or header is None or scope.get("query_string"):
            return self.auth.known(connection)
        memo: tuple[bytes, Principal] | None = direct.memo
        if memo is not None and memo[0] == header:
            expires = memo[1].expires_at
            if expires is None or expires > time.time():
                return memo[1]
        principal = self.auth.known(connection)
        direct.memo = None if principal is None else (header, principal)
        return principal

    async def _authenticate(
        self, connection: RequestConnection, headers: Headers, address: str, request_id: str
    ) -> Principal:
        """The principal of a request whose token is not known yet: verified, or refused."""
        if limited := await self.limiter.unauthenticated_blocked(address):
            raise throttled(limited, headers, self.auth.challenge_headers())
        try:
            return await self.auth.authenticate(connection)
        except AuthFailure as refused:
            metrics.auth_failures.labels(refused.reason).inc()
            # A request without a token is the first step of OAuth discovery, not an attack:
            # it gets its challenge and does not spend the address's budget (T-SEC-6).
            if refused.reason != "no_token":
                await self.limiter.authentication_failed(address)
                who = Caller(refused.principal, request_id, address) if refused.principal else None
                if await self.limiter.may_record_denial(f"a:{address}"):
                    await self.audit.deny(
                        who, f"auth:{refused.reason}", address=address, request_id=request_id, **refused.detail
                    )
            raise
