"""The MCP endpoint (POST, GET and DELETE on /mcp) as a pure ASGI app, in small layers:

    host and origin guard (guard.py) → authenticate (authn.py) → rate limit (throttle.py)
    → read the JSON-RPC message (framing.py) → the wire's router (v2025_http.py, v2026.py)

Each layer refuses by raising a ``Refusal``; what any layer raises is answered in one place
(``refusal.py``). Every response carries X-Request-Id, and each request is one log line.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import time
from typing import Final

from starlette.types import Message, Receive, Scope, Send

from service.auth.base import Authenticator
from service.config import Settings
from service.domain.principal import Caller
from service.domain.task import Wire
from service.guard.ratelimit import RateLimiter
from service.mcp import jsonrpc
from service.mcp import v2026_wire as v2026
from service.mcp.authn import Authentication
from service.mcp.framing import VERSION_HEADER, read_message, wire_of
from service.mcp.guard import HostGuard
from service.mcp.http import DirectExchange, RequestConnection, RequestHeaders, direct_exchange, send_json
from service.mcp.jsonrpc import INTERNAL_ERROR
from service.mcp.refusal import answer, http_refusal, refusal_of
from service.mcp.throttle import Throttle
from service.mcp.v2025_http import SESSION_HEADER, V2025Http
from service.mcp.v2026 import V2026Surface
from service.observability import logging as logctx
from service.tasks.audit import AuditLog

log = logging.getLogger(__name__)

# Fresh request ids: 8 random hex digits per process, then a counter. Unique, not secret, and free of
# the getrandom() call a random id per request costs.
_ID_PREFIX = secrets.token_hex(4)
_id_counter = itertools.count(1)


def _new_id_prefix() -> None:  # a forked process must not repeat its parent's ids
    global _ID_PREFIX
    _ID_PREFIX = secrets.token_hex(4)


os.register_at_fork(after_in_child=_new_id_prefix)


def request_id_of(given: str | None) -> str:
    """The caller's X-Request-Id when it is a sane token, else a fresh one (logs and audit rows carry it)."""
    if given and len(given) <= 64 and all(c.isalnum() or c in "-_.:" for c in given):
        return given
    return f"{_ID_PREFIX}{next(_id_counter) & 0xFFFFFFFF:08x}"


class _Answer:
    """The endpoint's ``send``: every response carries X-Request-Id, and its status is noted for the
    log line. ``respond`` writes a whole JSON answer at once where the server offers it (send_json)."""

    __slots__ = ("_direct", "_request_id", "_send", "started", "status")

    def __init__(self, send: Send, direct: DirectExchange | None, request_id: bytes) -> None:
        self._send = send
        self._direct = direct
        self._request_id = request_id
        self.started = False
        self.status = 0

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.status = message["status"]
            message["headers"] = [*message.get("headers", []), (b"x-request-id", self._request_id)]
        await self._send(message)

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        if self._direct is None or self.started:
            return False
        headers.append((b"x-request-id", self._request_id))
        if not self._direct.respond(self._send, status, headers, body):
            headers.pop()
            return False
        self.started = True
        self.status = status
        return True


_WIRES: Final = {v2026.VERSION: Wire.V2026}
# A principal's (or address's) refused requests get one log line per this many seconds.
REFUSAL_LINE_INTERVAL_S: Final = 10.0


class McpEndpoint:
    def __init__(
        self, settings: Settings, authenticator: Authenticator, limiter: RateLimiter, audit: AuditLog,
        v2025: V2025Http, v2026: V2026Surface,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.guard = HostGuard(settings)
        self.authentication = Authentication(authenticator, limiter, audit)
        self.throttle = Throttle(limiter, audit, tenant_share=settings.effective_request_share)
        self.v2025 = v2025
        self.v2026 = v2026
        self._refusal_lines = logctx.OncePer(REFUSAL_LINE_INTERVAL_S)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = RequestHeaders(scope)
        request_id = request_id_of(headers.get("x-request-id"))
        logged = logctx.begin_request(request_id)
        started_at = time.perf_counter()
        respond = _Answer(send, direct_exchange(scope), request_id.encode())
        try:
            await self._serve(scope, receive, respond, headers, request_id, logged)
        except Exception:
            ref = secrets.token_hex(6)
            log.exception("unexpected error on %s /mcp (reference %s)", scope["method"], ref)
            if not respond.started:
                error = {"code": INTERNAL_ERROR, "message": f"internal error (reference {ref}); retry, or report it"}
                await send_json(send, 200, jsonrpc.error_message(None, error))
        finally:
            if log.isEnabledFor(logging.INFO):  # its extra is built per request otherwise
                self._request_line(scope, respond.status, started_at, logged)

    def _request_line(self, scope: Scope, status: int, started_at: float, logged: logctx.RequestContext) -> None:
        """The request's line. Refusals under load (429, 503) are counted in metrics; their lines
        are written at most once per principal (or address, before one is known) per interval,
        saying how many were held back."""
        extra: dict[str, object] = {
            "status": status,
            "duration_ms": round((time.perf_counter() - started_at) * 1000, 2),
        }
        if status in (429, 503):
            client = scope.get("client")
            key = (logged.tenant, logged.subject) if logged.tenant is not None else (client[0] if client else "-")
            due, held_back = self._refusal_lines.due(key)
            if not due:
                return
            if held_back:
                extra["held_back"] = held_back
        log.info("%s /mcp %s", scope["method"], status, extra=extra)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, headers: RequestHeaders, request_id: str,
        logged: logctx.RequestContext,
    ) -> None:  # fmt: skip
        try:
            self.guard.check(headers)
            client = scope.get("client")
            address = client[0] if client else "-"
            connection = RequestConnection(scope, receive, headers)
            principal = await self.authentication.principal(scope, connection, headers, address, request_id)
            caller = Caller(principal, request_id, address)
            logged.tenant, logged.subject = principal.tenant_id, principal.subject
            await self.throttle.check(caller, headers)
            with self.throttle.share(caller, headers):
                await self._route(scope, receive, send, headers, caller)
        except Exception as exc:
            refusal = refusal_of(exc, wire=_WIRES.get(headers.get(VERSION_HEADER, ""), Wire.V2025))
            if refusal is None:
                raise
            await answer(send, refusal)

    async def _route(self, scope: Scope, receive: Receive, send: Send, headers: RequestHeaders, caller: Caller) -> None:
        method = scope["method"]
        if method == "POST":
            message = await read_message(receive, headers, max_body_bytes=self.settings.max_body_bytes)
            logctx.note_params(message.get("method"), message.get("params"))
            if wire_of(headers, message) is Wire.V2026:
                logctx.note_wire(Wire.V2026.value)
                await self.v2026.handle(scope, receive, send, headers, caller, message)
            else:
                logctx.note_wire(Wire.V2025.value)
                await self.v2025.post(scope, receive, send, headers, caller, message)
        elif headers.get(VERSION_HEADER) == v2026.VERSION and not headers.get(SESSION_HEADER):
            # X-HTTP-9: 2026-07-28 has no GET stream and no sessions to end.
            raise http_refusal(405, f"{method} is not used on 2026-07-28", {"Allow": "POST"})
        elif method == "GET":
            logctx.note_wire(Wire.V2025.value)
            await self.v2025.get(receive, send, headers, caller)
        elif method == "DELETE":
            await self.v2025.delete(send, headers, caller.principal)
        else:
            raise http_refusal(405, f"method {method} not allowed", {"Allow": "GET, POST, DELETE"})
