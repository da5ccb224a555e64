"""Streamable HTTP (2025-11-25): POST, GET and DELETE on the MCP endpoint, as a pure ASGI app."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import time
from collections.abc import Coroutine, Iterator
from typing import Any, Final
from urllib.parse import urlsplit

import orjson
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from service.auth.base import Authenticator, AuthFailure
from service.concurrency import eager
from service.config import Settings, is_loopback_host
from service.domain.errors import DomainError, InvalidArguments
from service.domain.inputs import InputResponse
from service.domain.principal import Caller, Principal
from service.guard.ratelimit import RateLimited, RateLimiter
from service.mcp import ext_wire as ext
from service.mcp import jsonrpc
from service.mcp.errors import to_rpc
from service.mcp.http import (
    DirectExchange,
    HttpError,
    RequestConnection,
    RequestHeaders,
    direct_exchange,
    send_json,
    until_done_or_gone,
)
from service.mcp.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, PARSE_ERROR, RATE_LIMITED, RpcFailure
from service.mcp.modern import ModernSurface
from service.mcp.plain import CallKey
from service.mcp.sse import send_sse
from service.mcp.surface import SUPPORTED_VERSIONS, Call, Streamed, Surface
from service.observability import logging as logctx
from service.observability import metrics
from service.tasks.audit import AuditLog
from service.tasks.service import TaskService
from service.tasks.sessions import Session, SessionService

log = logging.getLogger(__name__)

SESSION_HEADER: Final = "mcp-session-id"
VERSION_HEADER: Final = "mcp-protocol-version"
JSON: Final = "application/json"
EVENT_STREAM: Final = "text/event-stream"


class _RpcRefusal(Exception):
    """A request refused outside a JSON-RPC handler, but with its id (2026-07-28 envelope errors)."""

    def __init__(self, status: int, request_id: Any, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.request_id = request_id
        self.error: dict[str, Any] = {"code": code, "message": message}
        if data is not None:
            self.error["data"] = data


class StreamCounts:
    """Open GET streams per session and per principal in this process (issue 14 §7: only the rate
    limit stopped a client holding 1,198 streams on one session)."""

    def __init__(self, per_session: int, per_principal: int) -> None:
        self.per_session = per_session
        self.per_principal = per_principal
        self.sessions: dict[tuple[str, str], int] = {}
        self.principals: dict[tuple[str, str], int] = {}

    @contextlib.contextmanager
    def hold(self, session: tuple[str, str], principal: tuple[str, str]) -> Iterator[None]:
        if self.sessions.get(session, 0) >= self.per_session:
            # As the official SDKs answer a second GET stream on a session (H-MULTI-1 is a MAY).
            raise HttpError(
                409, INVALID_REQUEST, f"Conflict: this session already has {self.per_session} open GET stream(s)"
            )
        if self.principals.get(principal, 0) >= self.per_principal:
            raise HttpError(
                429, RATE_LIMITED, f"too many open GET streams for this principal (at most {self.per_principal})",
                {"Retry-After": "5"},
            )  # fmt: skip
        for counts, key in ((self.sessions, session), (self.principals, principal)):
            counts[key] = counts.get(key, 0) + 1
        try:
            yield
        finally:
            for counts, key in ((self.sessions, session), (self.principals, principal)):
                counts[key] -= 1
                if counts[key] == 0:
                    del counts[key]


_GONE: Final = object()  # a request whose client went away before its answer


def _throttled(limited: RateLimited, headers: Headers, extra: dict[str, str] | None = None) -> HttpError:
    """HTTP 429 with Retry-After and a JSON-RPC error body: on 2025-11-25 a code of the server-defined
    range, on 2026-07-28 our application code (X-ERR-2)."""
    metrics.rate_limited.labels(limited.scope).inc()
    code = ext.RATE_LIMITED if headers.get(VERSION_HEADER) == ext.MODERN else RATE_LIMITED
    return HttpError(429, code, limited.message, {"Retry-After": str(limited.retry_after_s), **(extra or {})})


# Fresh request ids: 8 random hex digits per process, then a counter. Unique, not secret, and free of
# the getrandom() call a random id per request costs.
_ID_PREFIX = secrets.token_hex(4)
_id_counter = itertools.count(1)


def _new_id_prefix() -> None:  # a forked process must not repeat its parent's ids
    global _ID_PREFIX
    _ID_PREFIX = secrets.token_hex(4)


os.register_at_fork(after_in_child=_new_id_prefix)


def _request_id(given: str | None) -> str:
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


def _hostname(url: str) -> str:
    """The host of a URL-ish header value; '' (never an exception) when it is malformed."""
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


def _has_nul(value: Any) -> bool:
    """Any string in the document holds U+0000? Iterative: a deeply nested body (orjson accepts
    1024 levels) must not exhaust Python's recursion limit."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


_ACCEPTS: dict[tuple[str, str], bool] = {}


def _accepts(accept: str, media: str) -> bool:
    """Does an Accept header admit ``media``? Remembered per header value: clients send the same
    few values on every request (a bounded table; it starts afresh when full)."""
    known = _ACCEPTS.get((accept, media))
    if known is not None:
        return known
    kinds = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    major = media.split("/", 1)[0]
    answer = media in kinds or "*/*" in kinds or f"{major}/*" in kinds
    if len(_ACCEPTS) >= 1024:
        _ACCEPTS.clear()
    _ACCEPTS[(accept, media)] = answer
    return answer


class McpEndpoint:
    """The MCP endpoint. Thin: check the HTTP envelope, authenticate, frame, dispatch."""

    def __init__(
        self,
        settings: Settings,
        authenticator: Authenticator,
        sessions: SessionService,
        tasks: TaskService,
        surface: Surface,
        limiter: RateLimiter,
        audit: AuditLog,
        modern: ModernSurface,
    ) -> None:
        self.settings = settings
        self.auth = authenticator
        self.limiter = limiter
        self.audit = audit
        self.sessions = sessions
        self.tasks = tasks
        self.surface = surface
        self.modern = modern
        public = urlsplit(settings.effective_public_url)
        self._public_host = (public.hostname or "").lower()
        self._public_origin = f"{public.scheme}://{public.netloc}".lower()
        self._keepalive_s = settings.sse_keepalive_ms / 1000
        self._disconnect_grace_s = settings.plain_call_disconnect_grace_s
        self._get_streams = StreamCounts(settings.max_get_streams_per_session, settings.max_get_streams_per_principal)
        self._hosts: dict[str, bool] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = RequestHeaders(scope)
        request_id = _request_id(headers.get("x-request-id"))
        logged = logctx.begin_request(request_id)
        started_at = time.perf_counter()
        answer = _Answer(send, direct_exchange(scope), request_id.encode())
        try:
            await self._serve(scope, receive, answer, headers, logged)
        except Exception:
            ref = secrets.token_hex(6)
            log.exception("unexpected error on %s /mcp (reference %s)", scope["method"], ref)
            if not answer.started:
                error = {"code": INTERNAL_ERROR, "message": f"internal error (reference {ref}); retry, or report it"}
                await send_json(send, 200, jsonrpc.error_message(None, error))
        finally:
            if log.isEnabledFor(logging.INFO):  # its extra is built per request otherwise
                log.info(
                    "%s /mcp %s",
                    scope["method"],
                    answer.status,
                    extra={"status": answer.status, "duration_ms": round((time.perf_counter() - started_at) * 1000, 2)},
                )

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, headers: RequestHeaders, logged: logctx.RequestContext
    ) -> None:
        method = scope["method"]
        try:
            self._check_host_and_origin(headers)
            client = scope.get("client")
            address = client[0] if client else "-"
            request_id = logged.request_id
            connection = RequestConnection(scope, receive, headers)
            # A token verified before costs no work (the hot path). Any other request from an
            # address over its failed-authentication budget is refused before any token work.
            principal = self._known(scope, connection, headers)
            if principal is None:
                principal = await self._authenticate(connection, headers, address, request_id)
            caller = Caller(principal, request_id, address)
            logged.tenant = principal.tenant_id
            if limited := await self.limiter.request(principal):
                metrics.denied("rate_limited", principal.tenant_id)
                if await self.limiter.may_record_denial(f"p:{principal.tenant_id}\x00{principal.subject}"):
                    await self.audit.deny(caller, "rate_limited", scope=limited.scope)
                raise _throttled(limited, headers)
            if method == "POST":
                await self._post(scope, receive, send, headers, caller)
            elif headers.get(VERSION_HEADER) == ext.MODERN and not headers.get(SESSION_HEADER):
                # X-HTTP-9: 2026-07-28 has no GET stream and no sessions to end.
                raise HttpError(405, INVALID_REQUEST, f"{method} is not used on 2026-07-28", {"Allow": "POST"})
            elif method == "GET":
                await self._get(receive, send, headers, caller)
            elif method == "DELETE":
                await self._delete(send, headers, caller.principal)
            else:
                raise HttpError(405, INVALID_REQUEST, f"method {method} not allowed", {"Allow": "GET, POST, DELETE"})
        except _RpcRefusal as exc:
            await send_json(send, exc.status, jsonrpc.error_message(exc.request_id, exc.error))
        except AuthFailure as exc:
            body = jsonrpc.error_message(None, {"code": INVALID_REQUEST, "message": exc.description})
            await send_json(send, exc.status, body, exc.headers)
        except HttpError as exc:
            await send_json(
                send,
                exc.status,
                jsonrpc.error_message(None, {"code": exc.code, "message": exc.message}),
                exc.headers,
            )
        except DomainError as exc:
            failure = to_rpc(exc, modern=Headers(scope=scope).get(VERSION_HEADER) == ext.MODERN)
            await send_json(
                send,
                failure.http_status if failure.http_status != 200 else 503,
                jsonrpc.error_message(None, failure.error_object()),
                failure.headers,
            )

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
            raise _throttled(limited, headers, self.auth.challenge_headers())
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

    # --- envelope checks -----------------------------------------------------------------------

    def host_allowed(self, host: str) -> bool:
        """Our own Host names only: the public URL's, the allow-list, loopback when bound to loopback.
        Remembered per Host value (settings do not change while serving; a bounded table)."""
        known = self._hosts.get(host)
        if known is not None:
            return known
        hostname = _hostname(f"//{host}")
        allowed = (
            hostname == self._public_host
            or hostname in self.settings.host_allowlist
            or (is_loopback_host(self.settings.host) and is_loopback_host(hostname))
        )
        if len(self._hosts) >= 1024:
            self._hosts.clear()
        self._hosts[host] = allowed
        return allowed

    def _check_host_and_origin(self, headers: Headers) -> None:
        """H-ORIGIN-1/2 and DNS-rebinding defence: only our own Host names and allowed Origins."""
        host = headers.get("host", "")
        if not self.host_allowed(host):
            raise HttpError(403, INVALID_REQUEST, f"Host {host!r} is not served here (DNS rebinding protection)")
        origin = headers.get("origin")
        if origin is None:
            return
        origin_l = origin.rstrip("/").lower()
        origin_host = _hostname(origin_l)
        if (
            origin_l == self._public_origin
            or origin_l in self.settings.origin_allowlist
            or (is_loopback_host(self.settings.host) and is_loopback_host(origin_host))
        ):
            return
        raise HttpError(403, INVALID_REQUEST, f"Origin {origin!r} is not allowed; set MCP_TASKS_ALLOWED_ORIGINS")

    def _era(self, headers: Headers, message: dict[str, Any]) -> str:
        """§14.1: which surface serves this request, decided from it alone."""
        value = headers.get(VERSION_HEADER)
        if value == ext.MODERN:
            return ext.MODERN  # initialize too: it does not exist on 2026-07-28 (404)
        if message.get("method") == "initialize":
            return "2025-11-25"
        request_id = message.get("id") if jsonrpc.valid_id(message.get("id")) else None
        if value is None:
            params = message.get("params")
            meta = params.get("_meta") if isinstance(params, dict) else None
            if isinstance(meta, dict) and ext.META_VERSION in meta:
                raise _RpcRefusal(400, request_id, ext.HEADER_MISMATCH,
                                  "Header mismatch: 2026-07-28 requests carry MCP-Protocol-Version")  # fmt: skip
            return "2025-11-25"  # a session's request from a client that sends no header (as before)
        if value in SUPPORTED_VERSIONS:
            return "2025-11-25"
        supported = [ext.MODERN, "2025-11-25"]  # as server/discover lists them
        raise _RpcRefusal(400, request_id, ext.UNSUPPORTED_VERSION,
                          f"Unsupported protocol version {value!r}; supported: {', '.join(supported)}",
                          {"supported": supported, "requested": value})  # fmt: skip

    def _check_version_header(self, headers: Headers) -> None:
        """H-VER-3: an unsupported MCP-Protocol-Version is 400. A supported value that differs from
        the session's is accepted (decision T-4): the negotiated version governs behaviour."""
        value = headers.get(VERSION_HEADER)
        if value is not None and value not in SUPPORTED_VERSIONS:
            raise HttpError(
                400,
                INVALID_REQUEST,
                f"Unsupported MCP-Protocol-Version {value!r}; supported: {', '.join(SUPPORTED_VERSIONS)}",
            )

    async def _session(self, headers: Headers, principal: Principal) -> Session:
        session_id = headers.get(SESSION_HEADER)
        if not session_id:
            raise HttpError(400, INVALID_REQUEST, "Bad Request: missing Mcp-Session-Id header; send initialize first")
        session = await self.sessions.resolve(principal, session_id)
        if session is None:
            # H-SESS-5, H-SESS-7: unknown, ended, or another principal's session.
            raise HttpError(404, INVALID_REQUEST, "Session not found: initialize a new session")
        self._check_version_header(headers)
        return session

    async def _read_body(self, receive: Receive, headers: Headers) -> bytes:
        limit = self.settings.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HttpError(413, INVALID_REQUEST, f"request body over {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HttpError(400, INVALID_REQUEST, "client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise HttpError(413, INVALID_REQUEST, f"request body over {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    # --- POST ----------------------------------------------------------------------------------

    async def _post(self, scope: Scope, receive: Receive, send: Send, headers: Headers, caller: Caller) -> None:
        content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != JSON:
            raise HttpError(415, INVALID_REQUEST, "Content-Type must be application/json")
        accept = headers.get("accept", "")
        if not (_accepts(accept, JSON) and _accepts(accept, EVENT_STREAM)):
            raise HttpError(
                406,
                INVALID_REQUEST,
                "Not Acceptable: Accept must list application/json and text/event-stream",
            )
        body = await self._read_body(receive, headers)
        try:
            message = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise HttpError(400, PARSE_ERROR, "Parse error: the body is not valid UTF-8 JSON") from None
        # PostgreSQL cannot store U+0000; refuse it here rather than fail deep inside (cheap pre-check first).
        if b"\\u0000" in body and _has_nul(message):
            if isinstance(message, dict) and "method" in message and jsonrpc.valid_id(message.get("id")):
                error = {"code": INVALID_PARAMS, "message": "strings must not contain the NUL character (U+0000)"}
                await send_json(send, 200, jsonrpc.error_message(message["id"], error))
                return
            raise HttpError(400, INVALID_REQUEST, "strings must not contain the NUL character (U+0000)")
        if isinstance(message, list):
            raise HttpError(400, INVALID_REQUEST, "Invalid Request: batches are not supported (H-GEN-3)")
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            raise HttpError(
                400, INVALID_REQUEST, 'Invalid Request: expected a JSON-RPC 2.0 object with "jsonrpc": "2.0"'
            )

        if self._era(headers, message) == ext.MODERN:
            await self.modern.handle(scope, receive, send, headers, caller, message)
            return
        if "method" in message:
            method = message["method"]
            if not isinstance(method, str):
                raise HttpError(400, INVALID_REQUEST, "Invalid Request: method must be a string")
            if "id" not in message:
                await self._notification(send, headers, caller, method, message.get("params"))
                return
            label = metrics.method(method)
            logctx.note_method(label)
            started = time.perf_counter()
            # Only tasks/result waits for tasks (its latency leaves the waits out).
            waits = metrics.track_waits() if label == "tasks/result" else None
            outcome: str = "internal_error"
            code: int | None = INTERNAL_ERROR
            wire = {"wire": "none"}  # the session's protocol version, once known
            try:
                outcome, code = await self._request(scope, receive, send, headers, caller, message, wire)
            except HttpError as exc:  # answered by _serve: a refusal, not a fault of ours
                outcome, code = "error", exc.code
                raise
            except DomainError as exc:
                outcome, code = "error", to_rpc(exc).code
                raise
            finally:
                elapsed = time.perf_counter() - started
                if code is not None:
                    metrics.labelled(metrics.request_errors, label, metrics.rpc_code(code), wire["wire"]).inc()
                latency = elapsed if waits is None else max(0.0, elapsed - sum(waits))
                metrics.request_meter.record(label, outcome, wire["wire"], latency)
                if waits is not None:
                    metrics.task_result_seconds.observe(elapsed)
            return
        if "id" in message and ("result" in message) != ("error" in message):
            await self._client_response(send, headers, caller, message)
            return
        raise HttpError(400, INVALID_REQUEST, "Invalid Request: neither a request, a notification nor a response")

    async def _request(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: Headers,
        caller: Caller,
        message: dict[str, Any],
        wire: dict[str, str],
    ) -> tuple[str, int | None]:
        """Answer one request; returns its outcome and, for an error, its JSON-RPC code, and notes the
        session's protocol version in ``wire`` (for metrics)."""
        request_id = message["id"]
        if not jsonrpc.valid_id(request_id):
            raise HttpError(400, INVALID_REQUEST, "Invalid Request: id must be a string or an integer")
        plain_key = None  # a tools/call: how to stop its plain call, should its client go away
        params = message.get("params", {})
        if params is None:
            params = {}
        method = message["method"]
        extra: dict[str, str] = {}
        try:
            if not isinstance(params, dict):
                raise RpcFailure(INVALID_PARAMS, "params must be an object")
            if method == "initialize":
                self._check_version_header(headers)
                version = self.surface.negotiate(params)
                wire["wire"] = version
                caps = params.get("capabilities") or {}
                if not isinstance(caps, dict):
                    raise RpcFailure(INVALID_PARAMS, "capabilities must be an object")
                info = params.get("clientInfo") if isinstance(params.get("clientInfo"), dict) else None
                jsonrpc.check_client_data("capabilities", caps, self.settings.max_client_capabilities_bytes)
                jsonrpc.check_client_data("clientInfo", info, self.settings.max_client_info_bytes)
                session = await self.sessions.open(caller.principal, version, caps, info)
                extra["Mcp-Session-Id"] = session.session_id
                reply: Any = self.surface.initialize_result(version)
            else:
                session = await self._session(headers, caller.principal)
                wire["wire"] = metrics.wire(session.protocol_version)
                call = Call(caller, session, request_id, params)
                if method == "tools/call":
                    plain_key = call.cancel_key
                    reply = await self._unless_gone(scope, receive, self.surface.dispatch(method, call), plain_key)
                    if reply is _GONE:
                        return "disconnected", None
                else:
                    reply = await self.surface.dispatch(method, call)
        except RpcFailure as failure:
            await send_json(
                send,
                failure.http_status,
                jsonrpc.error_message(request_id, failure.error_object()),
                failure.headers,
            )
            return "error", failure.code
        except (HttpError, DomainError):
            raise
        except Exception:
            ref = secrets.token_hex(6)
            log.exception("internal error handling %s (ref %s)", method, ref)
            error = {
                "code": INTERNAL_ERROR,
                "message": f"internal error (reference {ref}); retry, or report the reference",
            }
            await send_json(send, 200, jsonrpc.error_message(request_id, error))
            return "internal_error", INTERNAL_ERROR
        if isinstance(reply, Streamed):
            abort = asyncio.Event()
            if reply.cancel_key is not None:
                self.surface.inflight.calls.setdefault(reply.cancel_key, abort.set)
            try:
                await send_sse(send, receive, reply.messages, headers=extra, keepalive_s=self._keepalive_s, abort=abort)
            finally:
                if reply.cancel_key is not None and self.surface.inflight.calls.get(reply.cancel_key) == abort.set:
                    del self.surface.inflight.calls[reply.cancel_key]
                if plain_key is not None:  # the stream ended with the call still running: its client left
                    self.surface.inflight.abandon(plain_key, self._disconnect_grace_s)
        else:
            await send_json(send, 200, jsonrpc.result_message(request_id, reply), extra)
        return "ok", None

    async def _unless_gone(
        self, scope: Scope, receive: Receive, work: Coroutine[Any, Any, Any], plain_key: CallKey
    ) -> Any:
        """``work``'s reply, or _GONE if the client disconnected first. 2025-11-25 does not treat
        a disconnect as a cancellation, but a plain call nobody waits for is stopped after
        MCP_TASKS_PLAIN_CALL_DISCONNECT_GRACE_S (issue 14 §7, docs/decisions.md). Its first step
        runs at once: a call that ends in it (most do) needs no watch on its client."""
        running = eager.start(work)
        if not running.done():
            try:
                await until_done_or_gone(scope, receive, running)
            except BaseException:  # this request was cancelled (a shutdown): so is the call
                running.cancel()
                raise
            if not running.done():
                running.cancel()  # the handler only waits to choose JSON or SSE; the call runs in a task of its own
                with contextlib.suppress(BaseException):
                    await running
                self.surface.inflight.abandon(plain_key, self._disconnect_grace_s)
                return _GONE
        return running.result()

    async def _notification(self, send: Send, headers: Headers, caller: Caller, method: str, params: Any) -> None:
        """H-POST-2: accepted notifications get 202 and no body."""
        if method != "notifications/initialized" or headers.get(SESSION_HEADER):
            session = await self._session(headers, caller.principal)
        else:
            session = None
        if method == "notifications/cancelled" and isinstance(params, dict) and session is not None:
            # C-3/D-8: this only cancels plain requests; tasks are cancelled with tasks/cancel.
            rid = params.get("requestId")
            if jsonrpc.valid_id(rid):
                await self.surface.inflight.cancel((caller.principal.tenant_id, session.session_id, repr(rid)))
        await send_json(send, 202, None)

    async def _client_response(self, send: Send, headers: Headers, caller: Caller, message: dict[str, Any]) -> None:
        """The client's answer to our request (T-INPUT-5): correlate by id, under this principal."""
        await self._session(headers, caller.principal)
        rpc_id = message["id"]
        if not jsonrpc.valid_id(rpc_id):
            raise HttpError(400, INVALID_REQUEST, "Invalid response: id must be a string or an integer")
        if "result" in message:
            result = message["result"]
            response = InputResponse(result=result if isinstance(result, dict) else {})
        else:
            error = message["error"]
            response = InputResponse(error=error if isinstance(error, dict) else {})
        key = str(rpc_id)
        try:
            answered = await self.tasks.answer(caller, None, {key: response})
        except InvalidArguments as exc:
            # Not a usable answer to the question: the tool gets it as the client's error.
            refusal = {"code": INVALID_PARAMS, "message": f"invalid answer: {exc.message}"}
            answered = await self.tasks.answer(caller, None, {key: InputResponse(error=refusal)})
        if not answered:
            await self.surface.inflight.answer(caller.principal.tenant_id, caller.principal.subject, key, response)
        await send_json(send, 202, None)

    # --- GET and DELETE ------------------------------------------------------------------------

    async def _get(self, receive: Receive, send: Send, headers: Headers, caller: Caller) -> None:
        """H-GET-1/2: a stream for this session's task status changes and notices."""
        if not _accepts(headers.get("accept", ""), EVENT_STREAM):
            raise HttpError(406, INVALID_REQUEST, "Not Acceptable: GET needs Accept: text/event-stream")
        session = await self._session(headers, caller.principal)
        call = Call(caller, session, "", {})
        p = caller.principal
        with self._get_streams.hold((p.tenant_id, session.session_id), (p.tenant_id, p.subject)):
            # Subscribed before the headers go out, so nothing that happens after the client sees them is missed.
            async with self.tasks.session_events(caller.principal, session.session_id) as events:

                async def messages() -> Any:
                    async for event in events:
                        if (message := Surface.follow_message(call, event)) is not None:
                            yield message

                await send_sse(send, receive, messages(), keepalive_s=self._keepalive_s)

    async def _delete(self, send: Send, headers: Headers, principal: Principal) -> None:
        """H-SESS-6: end the session; its tasks live on, bound to the principal."""
        session = await self._session(headers, principal)
        await self.sessions.end(principal, session.session_id)
        await send_json(send, 200, None)
