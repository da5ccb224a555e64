"""Streamable HTTP of the 2025-11-25 wire: a session's POST (requests, notifications, the client's
answers), its GET stream and its DELETE. The methods themselves are ``v2025.py``'s."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Coroutine, Iterator
from typing import Any, Final

from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from service.concurrency import eager
from service.config import Settings
from service.domain.errors import DomainError, InvalidArguments
from service.domain.inputs import InputResponse
from service.domain.principal import Caller, Principal
from service.mcp import jsonrpc
from service.mcp.framing import EVENT_STREAM, VERSION_HEADER, accepts, check_client_data
from service.mcp.http import send_json, until_done_or_gone
from service.mcp.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, RATE_LIMITED, RequestId
from service.mcp.plain import CallKey
from service.mcp.refusal import Refusal, answer, http_refusal, refusal_of
from service.mcp.sse import StreamsClosing, send_sse
from service.mcp.traced import request_failed, request_span
from service.mcp.v2025 import SUPPORTED_VERSIONS, Call, Streamed, V2025Surface
from service.observability import logging as logctx
from service.observability import metrics
from service.tasks.service import TaskService
from service.tasks.sessions import Session, SessionService

log = logging.getLogger(__name__)

SESSION_HEADER: Final = "mcp-session-id"
_GONE: Final = object()  # a request whose client went away before its answer


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
            raise http_refusal(409, f"Conflict: this session already has {self.per_session} open GET stream(s)")
        if self.principals.get(principal, 0) >= self.per_principal:
            raise http_refusal(429, f"too many open GET streams for this principal (at most {self.per_principal})",
                               {"Retry-After": "5"}, code=RATE_LIMITED)  # fmt: skip
        for counts, key in ((self.sessions, session), (self.principals, principal)):
            counts[key] = counts.get(key, 0) + 1
        try:
            yield
        finally:
            for counts, key in ((self.sessions, session), (self.principals, principal)):
                counts[key] -= 1
                if counts[key] == 0:
                    del counts[key]


class PrincipalCounts:
    """Requests of one kind a (tenant, subject) has open on this process, at most ``most`` (issue 42
    §1: one token held 600 tasks/result streams on one task)."""

    def __init__(self, most: int, what: str) -> None:
        self.most = most
        self.what = what
        self.open: dict[tuple[str, str], int] = {}

    @contextlib.contextmanager
    def hold(self, principal: tuple[str, str]) -> Iterator[None]:
        held = self.open.get(principal, 0)
        if held >= self.most:
            raise Refusal(RATE_LIMITED, f"too many open {self.what} for this principal (at most {self.most} per "
                          "server): wait for one to end, or poll with tasks/get", status=429,
                          headers={"Retry-After": "5"})  # fmt: skip
        self.open[principal] = held + 1
        try:
            yield
        finally:
            if (left := self.open[principal] - 1) > 0:
                self.open[principal] = left
            else:
                del self.open[principal]


def check_version_header(headers: Headers) -> None:
    """H-VER-3: an unsupported MCP-Protocol-Version is 400. A supported value that differs from
    the session's is accepted (decision T-4): the negotiated version governs behaviour."""
    value = headers.get(VERSION_HEADER)
    if value is not None and value not in SUPPORTED_VERSIONS:
        raise http_refusal(
            400, f"Unsupported MCP-Protocol-Version {value!r}; supported: {', '.join(SUPPORTED_VERSIONS)}"
        )


class V2025Http:
    def __init__(
        self, settings: Settings, sessions: SessionService, tasks: TaskService, surface: V2025Surface,
        streams: StreamsClosing | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        # A shutdown ends GET streams when it begins, other streams just before the server would cut them.
        self.streams = streams if streams is not None else StreamsClosing()
        self.sessions = sessions
        self.tasks = tasks
        self.surface = surface
        self._keepalive_s = settings.sse_keepalive_ms / 1000
        self._disconnect_grace_s = settings.plain_call_disconnect_grace_s
        self._get_streams = StreamCounts(settings.max_get_streams_per_session, settings.max_get_streams_per_principal)
        self._result_streams = PrincipalCounts(settings.max_result_streams_per_principal, "tasks/result requests")

    async def _session(self, headers: Headers, principal: Principal) -> Session:
        session_id = headers.get(SESSION_HEADER)
        if not session_id:
            raise http_refusal(400, "Bad Request: missing Mcp-Session-Id header; send initialize first")
        session = await self.sessions.resolve(principal, session_id)
        if session is None:
            # H-SESS-5, H-SESS-7: unknown, ended, or another principal's session.
            raise http_refusal(404, "Session not found: initialize a new session")
        check_version_header(headers)
        return session

    # --- POST ----------------------------------------------------------------------------------

    async def post(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers, caller: Caller, message: dict[str, Any]
    ) -> None:
        if "method" in message:
            method = message["method"]
            if not isinstance(method, str):
                raise http_refusal(400, "Invalid Request: method must be a string")
            if "id" not in message:
                await self._notification(send, headers, caller, method, message.get("params"))
                return
            await self._measured(scope, receive, send, headers, caller, message, method)
            return
        if "id" in message and ("result" in message) != ("error" in message):
            await self._client_response(send, headers, caller, message)
            return
        raise http_refusal(400, "Invalid Request: neither a request, a notification nor a response")

    async def _measured(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers, caller: Caller, message: dict[str, Any],
        method: str,
    ) -> None:  # fmt: skip
        """A request, counted: its latency, its outcome and (an error) its code, per wire."""
        label = metrics.method(method)
        logctx.note_method(label)
        started = time.perf_counter()
        # Only tasks/result waits for tasks (its latency leaves the waits out).
        waits = metrics.track_waits() if label == "tasks/result" else None
        outcome: str = "internal_error"
        code: int | None = INTERNAL_ERROR
        wire = {"wire": "none"}  # the session's protocol version, once known
        with request_span(label, message, headers, caller, protocol_version=None):
            try:
                outcome, code = await self._request(scope, receive, send, headers, caller, message, wire)
            except (Refusal, DomainError) as exc:  # answered by the endpoint: a refusal, not a fault of ours
                refusal = refusal_of(exc)
                outcome, code = "error", refusal.code if refusal is not None else INTERNAL_ERROR
                raise
            finally:
                request_failed(code, outcome)
                elapsed = time.perf_counter() - started
                if code is not None:
                    metrics.labelled(metrics.request_errors, label, metrics.rpc_code(code), wire["wire"]).inc()
                latency = elapsed if waits is None else max(0.0, elapsed - sum(waits))
                metrics.request_meter.record(label, outcome, wire["wire"], latency)  # in the span: its exemplar
                if waits is not None:
                    metrics.task_result_seconds.observe(elapsed)

    async def _request(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers, caller: Caller, message: dict[str, Any],
        wire: dict[str, str],
    ) -> tuple[str, int | None]:  # fmt: skip
        """Answer one request; returns its outcome and, for an error, its JSON-RPC code, and notes the
        session's protocol version in ``wire`` (for metrics)."""
        request_id = message["id"]
        if not jsonrpc.valid_id(request_id):
            raise http_refusal(400, "Invalid Request: id must be a string or an integer")
        if jsonrpc.id_too_long(request_id):
            raise http_refusal(400, f"Invalid Request: id is longer than {jsonrpc.MAX_ID_CHARS} characters")
        plain_key = None  # a tools/call: how to stop its plain call, should its client go away
        params = message.get("params", {})
        if params is None:
            params = {}
        method = message["method"]
        extra: dict[str, str] = {}
        # A tasks/result request holds one of its principal's result streams until it is answered.
        held = contextlib.ExitStack()
        with held:
            try:
                if not isinstance(params, dict):
                    raise Refusal(INVALID_PARAMS, "params must be an object")
                if method == "initialize":
                    session, reply = await self._initialize(headers, caller, params)
                    wire["wire"] = session.protocol_version
                    extra["Mcp-Session-Id"] = session.session_id
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
                        if method == "tasks/result":
                            held.enter_context(self._result_streams.hold((caller.principal.tenant_id,
                                                                          caller.principal.subject)))  # fmt: skip
                        reply = await self.surface.dispatch(method, call)
            except Refusal as refusal:
                if refusal.envelope:  # answered by the endpoint, without this request's id
                    raise
                refusal.request_id = request_id
                await answer(send, refusal)
                return "error", refusal.code
            except DomainError:
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
            await self._reply(send, receive, headers, request_id, reply, extra, plain_key)
        return "ok", None

    async def _initialize(self, headers: Headers, caller: Caller, params: dict[str, Any]) -> tuple[Session, Any]:
        check_version_header(headers)
        version = self.surface.negotiate(params)
        caps = params.get("capabilities") or {}
        if not isinstance(caps, dict):
            raise Refusal(INVALID_PARAMS, "capabilities must be an object")
        info = params.get("clientInfo") if isinstance(params.get("clientInfo"), dict) else None
        check_client_data("capabilities", caps, self.settings.max_client_capabilities_bytes)
        check_client_data("clientInfo", info, self.settings.max_client_info_bytes)
        session = await self.sessions.open(caller.principal, version, caps, info)
        return session, self.surface.initialize_result(version)

    async def _reply(
        self, send: Send, receive: Receive, headers: Headers, request_id: RequestId, reply: Any,
        extra: dict[str, str], plain_key: CallKey | None,
    ) -> None:  # fmt: skip
        if not isinstance(reply, Streamed):
            await send_json(send, 200, jsonrpc.result_message(request_id, reply), extra)
            return
        abort = asyncio.Event()
        inflight = self.surface.inflight
        if reply.cancel_key is not None:
            inflight.calls.setdefault(reply.cancel_key, abort.set)
        try:
            await send_sse(send, receive, reply.messages, headers=extra, keepalive_s=self._keepalive_s, abort=abort,
                           stop=self.streams.deadline)  # fmt: skip
        finally:
            if reply.cancel_key is not None and inflight.calls.get(reply.cancel_key) == abort.set:
                del inflight.calls[reply.cancel_key]
            if plain_key is not None:  # the stream ended with the call still running: its client left
                inflight.abandon(plain_key, self._disconnect_grace_s)

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
            raise http_refusal(400, "Invalid response: id must be a string or an integer")
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

    async def get(self, receive: Receive, send: Send, headers: Headers, caller: Caller) -> None:
        """H-GET-1/2: a stream for this session's task status changes and notices."""
        if not accepts(headers.get("accept", ""), EVENT_STREAM):
            raise http_refusal(406, "Not Acceptable: GET needs Accept: text/event-stream")
        session = await self._session(headers, caller.principal)
        call = Call(caller, session, "", {})
        p = caller.principal
        with self._get_streams.hold((p.tenant_id, session.session_id), (p.tenant_id, p.subject)):
            # Subscribed before the headers go out, so nothing that happens after the client sees them is missed.
            async with self.tasks.streams.session_events(caller.principal, session.session_id) as events:

                async def messages() -> Any:
                    async for event in events:
                        if (message := V2025Surface.follow_message(call, event)) is not None:
                            yield message

                await send_sse(send, receive, messages(), keepalive_s=self._keepalive_s, stop=self.streams.begun)

    async def delete(self, send: Send, headers: Headers, principal: Principal) -> None:
        """H-SESS-6: end the session; its tasks live on, bound to the principal."""
        session = await self._session(headers, principal)
        await self.sessions.end(principal, session.session_id)
        await send_json(send, 200, None)
