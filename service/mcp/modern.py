"""The 2026-07-28 surface: stateless requests, per-request `_meta`, and the Tasks extension.

Every request carries its protocol version and client capabilities in ``params._meta`` and names its
method (and, for ``tasks/*``, its task) in headers; nothing is remembered between requests, so any
replica serves any request. Tasks are the same rows as on 2025-11-25, rendered here by the
extension's rules (docs/decisions.md lists the XD-* choices).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from service.config import Settings
from service.domain.errors import CapacityExceeded, DomainError, TaskAlreadyTerminal, TaskNotFound
from service.domain.events import LOG_LEVELS, LogEntry, Progress, TaskEvent
from service.domain.inputs import InputResponse, PendingInput
from service.domain.principal import Caller
from service.domain.task import OutcomeKind, Surface
from service.domain.values import frozen
from service.guard.ratelimit import RateLimiter
from service.mcp import ext_wire as ext
from service.mcp import jsonrpc
from service.mcp.errors import to_rpc
from service.mcp.http import HttpError, send_json, until_done_or_gone
from service.mcp.jsonrpc import INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, RequestId, RpcFailure
from service.mcp.sse import send_sse
from service.mcp.surface import Surface as LegacySurface
from service.mcp.wire import error_object, event_message
from service.observability import logging as logctx
from service.observability import metrics
from service.tasks.audit import AuditLog
from service.tasks.service import CallMode, CallResult, TaskService

METHOD_HEADER: Final = "mcp-method"
RESOURCE_NOT_FOUND: Final = -32002
NAME_HEADER: Final = "mcp-name"
TASK_METHODS: Final = frozenset({"tasks/get", "tasks/update", "tasks/cancel"})
LOOKUPS: Final = frozenset({"tasks/get", "tasks/update", "tasks/cancel"})
# Methods whose Mcp-Name names a parameter: (the parameter, whether the header is required).
NAMED: Final = {"tools/call": ("name", True), "prompts/get": ("name", False), "resources/read": ("uri", False)}
# Cache hints of list and read results (2026-07-28 caching): the registry is fixed per process.
CACHE_HINT: Final = {"ttlMs": 60_000, "cacheScope": "private"}
# The 2026-07-28 codes answered with HTTP 400 (§11), whoever raises them (a tool may, too).
HTTP_400_CODES: Final = frozenset({ext.HEADER_MISMATCH, ext.MISSING_CAPABILITY, ext.UNSUPPORTED_VERSION})


def _fail(code: int, message: str, data: Any = None, *, status: int = 200) -> RpcFailure:
    return RpcFailure(code, message, data, http_status=status)


def _header_value(raw: str | None) -> str | None:
    """X-HTTP-2: ``=?base64?<b64>?=`` is Base64 of the UTF-8 value."""
    if raw is None or not (raw.startswith("=?base64?") and raw.endswith("?=")):
        return raw
    try:
        return base64.b64decode(raw[9:-2], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise _fail(ext.HEADER_MISMATCH, "Mcp-Name is not valid =?base64?...?= text", status=400) from None


def _object(params: dict[str, Any], name: str, *, required: bool = False) -> dict[str, Any] | None:
    value = params.get(name)
    if value is None:
        if required:
            raise _fail(INVALID_PARAMS, f"missing params.{name}")
        return None
    if not isinstance(value, dict):
        raise _fail(INVALID_PARAMS, f"params.{name} must be an object")
    return value


def _string(params: dict[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str):
        raise _fail(INVALID_PARAMS, f"params.{name} must be a string" if name in params else f"missing params.{name}")
    return value


@frozen
class ModernCall:
    caller: Caller
    request_id: RequestId
    method: str
    params: dict[str, Any]
    capabilities: dict[str, Any]
    headers: Headers
    scope: Scope

    @property
    def declaring(self) -> bool:
        """The request declares the Tasks extension (X-NEG-4, X-NEG-8: a legacy ``tasks`` key does not)."""
        extensions = self.capabilities.get("extensions")
        return isinstance(extensions, dict) and isinstance(extensions.get(ext.EXTENSION), dict)

    def require_declaring(self) -> None:
        if not self.declaring:
            raise _fail(
                ext.MISSING_CAPABILITY,
                f"{self.method} needs the {ext.EXTENSION} extension: declare it in "
                f"_meta[{ext.META_CAPABILITIES!r}].extensions",
                {"requiredCapabilities": ext.REQUIRED_CAPABILITIES},
                status=400,
            )


class ModernSurface:
    def __init__(
        self,
        settings: Settings,
        tasks: TaskService,
        legacy: LegacySurface,
        limiter: RateLimiter,
        audit: AuditLog,
    ) -> None:
        self.settings = settings
        self.tasks = tasks
        self.legacy = legacy
        self.registry = legacy.registry
        self.limiter = limiter
        self.audit = audit
        self.grace_s = settings.task_grace_ms / 1000
        self.poll_s = settings.poll_interval_ms / 1000
        self.keepalive_s = settings.sse_keepalive_ms / 1000
        self.subscriptions: dict[tuple[str, str, str], int] = {}
        # Set when the process starts to shut down: open subscriptions end gracefully (XD-14).
        self.closing = asyncio.Event()
        self._methods = {
            "server/discover": self.discover,
            "tools/list": self.tools_list,
            "tools/call": self.tools_call,
            "tasks/get": self.tasks_get,
            "tasks/update": self.tasks_update,
            "tasks/cancel": self.tasks_cancel,
            "resources/list": self._core,
            "resources/templates/list": self._core,
            "resources/read": self._core,
            "prompts/list": self._core,
            "prompts/get": self.prompts_get,
            "completion/complete": self._core,
        }

    # --- the envelope --------------------------------------------------------------------------

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers, caller: Caller, message: dict[str, Any]
    ) -> None:
        if "method" not in message:
            raise HttpError(400, INVALID_REQUEST, "2026-07-28 clients send no responses (X-HTTP-8)")
        method = message["method"]
        if not isinstance(method, str):
            raise HttpError(400, INVALID_REQUEST, "Invalid Request: method must be a string")
        if "id" not in message:
            await send_json(send, 202, None)  # notifications: accepted, nothing to do (X-CANCEL-6)
            return
        request_id = message["id"]
        if not jsonrpc.valid_id(request_id):
            raise HttpError(400, INVALID_REQUEST, "Invalid Request: id must be a string or an integer")
        label = metrics.method(method)
        logctx.note_method(label)
        started = time.perf_counter()
        outcome = "error"
        code: int | None = None
        try:
            handler = self._methods.get(method)
            if handler is None and method != "subscriptions/listen":
                # X-HTTP-5: tasks/result, tasks/list, initialize, ping... do not exist here; said first.
                raise _fail(METHOD_NOT_FOUND, f"Method not found: {method}", status=404)
            call = self._envelope(scope, caller, request_id, method, message.get("params"), headers)
            if handler is None:
                await self.listen(receive, send, call)
                outcome = "ok"
                return
            reply = await self._dispatch(handler, call, receive)
            outcome = "ok"
            if isinstance(reply, Streamed):
                await send_sse(send, receive, reply.messages, keepalive_s=self.keepalive_s)
                return
        except RpcFailure as failure:
            code = failure.code
            await send_json(
                send, failure.http_status, jsonrpc.error_message(request_id, failure.error_object()), failure.headers
            )
            return
        finally:
            if outcome != "ok":
                metrics.labelled(metrics.request_errors, label, metrics.rpc_code(code), ext.MODERN).inc()
            metrics.request_meter.record(label, outcome, ext.MODERN, time.perf_counter() - started)
        await send_json(send, 200, jsonrpc.result_message(request_id, reply))

    def _envelope(
        self, scope: Scope, caller: Caller, request_id: RequestId, method: str, params: Any, headers: Headers
    ) -> ModernCall:
        """§1, §10, §14.1: the headers match the body; `_meta` names this version and the capabilities."""
        if headers.get(METHOD_HEADER) != method:
            raise _fail(ext.HEADER_MISMATCH, "Header mismatch: Mcp-Method must equal the request's method", status=400)
        if not isinstance(params, dict):
            raise _fail(INVALID_PARAMS, "params must be an object with _meta (2026-07-28)", status=400)
        meta = params.get("_meta")
        if not isinstance(meta, dict):
            raise _fail(INVALID_PARAMS, "params._meta is required on 2026-07-28 (protocolVersion, clientCapabilities)",
                        status=400)  # fmt: skip
        version = meta.get(ext.META_VERSION)
        if version is None:
            raise _fail(INVALID_PARAMS, f"missing _meta[{ext.META_VERSION!r}]", status=400)
        if version != ext.MODERN:
            raise _fail(ext.HEADER_MISMATCH, "Header mismatch: MCP-Protocol-Version differs from _meta's protocolVersion",
                        status=400)  # fmt: skip
        capabilities = meta.get(ext.META_CAPABILITIES)
        if not isinstance(capabilities, dict):
            raise _fail(INVALID_PARAMS, f"_meta[{ext.META_CAPABILITIES!r}] must be an object", status=400)
        try:
            jsonrpc.check_client_data(ext.META_CAPABILITIES, capabilities, self.settings.max_client_capabilities_bytes)
            jsonrpc.check_client_data(
                ext.META_CLIENT_INFO, meta.get(ext.META_CLIENT_INFO), self.settings.max_client_info_bytes
            )
        except RpcFailure as too_big:
            too_big.http_status = 400  # as every other malformed _meta
            raise
        extensions = capabilities.get("extensions")
        if extensions is not None and not isinstance(extensions, dict):
            raise _fail(INVALID_PARAMS, "clientCapabilities.extensions must be an object", status=400)
        if (
            isinstance(extensions, dict)
            and ext.EXTENSION in extensions
            and not isinstance(extensions[ext.EXTENSION], dict)
        ):
            raise _fail(INVALID_PARAMS, f"clientCapabilities.extensions[{ext.EXTENSION!r}] must be an object (XD-23)",
                        status=400)  # fmt: skip
        call = ModernCall(caller, request_id, method, params, capabilities, headers, scope)
        if method in TASK_METHODS:
            task_id = params.get("taskId")
            name = _header_value(headers.get(NAME_HEADER))
            if name is None or name != task_id:
                raise _fail(ext.HEADER_MISMATCH, "Header mismatch: Mcp-Name must equal params.taskId", status=400)
            call.require_declaring()  # X-GET-9: before the lookup
        elif method in NAMED:
            field, required = NAMED[method]
            name = _header_value(headers.get(NAME_HEADER))
            if (name is None and required) or (name is not None and name.strip() != params.get(field)):
                raise _fail(ext.HEADER_MISMATCH, f"Header mismatch: Mcp-Name must equal params.{field}", status=400)
        return call

    async def _dispatch(self, handler: Any, call: ModernCall, receive: Receive) -> dict[str, Any] | Streamed:
        lookup = call.method in LOOKUPS
        if lookup and (limited := await self.limiter.lookups_blocked(call.caller.principal)):
            await self.audit.deny(call.caller, "rate_limited", scope=limited.scope)
            metrics.rate_limited.labels(limited.scope).inc()
            metrics.denied("not_found", call.caller.principal.tenant_id)
            raise RpcFailure(ext.RATE_LIMITED, limited.message, {"retryAfter": limited.retry_after_s}, http_status=429,
                             headers={"Retry-After": str(limited.retry_after_s)})  # fmt: skip
        try:
            result: dict[str, Any] | Streamed = await handler(call, receive)
            return result
        except TaskNotFound as exc:
            if lookup:
                await self.limiter.lookup_missed(call.caller.principal)
            raise to_rpc(exc, modern=True) from None
        except CapacityExceeded as exc:
            metrics.cap_refusals.labels(str(exc.details.get("scope", ""))).inc()
            metrics.denied("cap", call.caller.principal.tenant_id)
            raise to_rpc(exc, modern=True) from None
        except DomainError as exc:
            raise to_rpc(exc, modern=True) from None

    # --- methods -------------------------------------------------------------------------------

    async def discover(self, call: ModernCall, _receive: Receive) -> dict[str, Any]:
        """X-NEG-1/2/3, XD-19, XD-24."""
        capabilities: dict[str, Any] = {"tools": {"listChanged": False}, "extensions": {ext.EXTENSION: {}}}
        if self.registry.resources:
            capabilities["resources"] = {"subscribe": False, "listChanged": False}
        if self.registry.prompts:
            capabilities["prompts"] = {"listChanged": False}
            capabilities["completions"] = {}
        return ext.complete(
            {
                "supportedVersions": [ext.MODERN, "2025-11-25"],
                "capabilities": capabilities,
                "ttlMs": 300_000,
                "cacheScope": "private",
                "instructions": "Long-running tools may answer with a task: poll tasks/get, answer input with "
                "tasks/update, or subscribe with subscriptions/listen.",
            }
        )

    async def tools_list(self, call: ModernCall, _receive: Receive) -> dict[str, Any]:
        tools = [t.to_wire(with_execution=False) for t in self.registry.tools.values()]
        return ext.complete({"tools": tools, **CACHE_HINT})

    async def _core(self, call: ModernCall, _receive: Receive) -> dict[str, Any]:
        """Resources, prompts and completion: the same handlers as 2025-11-25, in 2026-07-28 form."""
        from service.mcp.surface import Call

        params = {k: v for k, v in call.params.items() if k != "_meta"}
        try:
            reply = await self.legacy.dispatch(call.method, Call(call.caller, None, call.request_id, params))
        except RpcFailure as failure:
            if failure.code == RESOURCE_NOT_FOUND:  # 2026-07-28 says -32602 (SEP-2164), with the uri
                raise _fail(INVALID_PARAMS, failure.message, failure.data) from None
            raise
        assert isinstance(reply, dict)
        if call.method in ("resources/list", "resources/templates/list", "resources/read", "prompts/list"):
            reply = {**reply, **CACHE_HINT}
        return ext.complete(reply)

    async def tools_call(self, call: ModernCall, receive: Receive) -> dict[str, Any] | Streamed:
        """X-CREATE-*, XD-5: a tool's task policy and the request's declaration pick how it may end."""
        name = _string(call.params, "name")
        arguments = _object(call.params, "arguments") or {}
        spec = self.tasks.registry.get(name)
        self._check_param_headers(call, spec.input_schema, arguments)
        responses = self._with_state(call, name, arguments, _responses(call.params.get("inputResponses")))
        if spec.task_support == "required":
            if not call.declaring:
                raise _fail(
                    ext.MISSING_CAPABILITY,
                    f"tool {name!r} runs only as a task: declare the {ext.EXTENSION} extension",
                    {"requiredCapabilities": ext.REQUIRED_CAPABILITIES},
                    status=400,
                )  # X-NEG-7
            mode = CallMode.REQUIRED
        elif spec.task_support == "optional" and call.declaring:
            mode = CallMode.OPTIONAL
        else:
            mode = CallMode.SYNC  # X-NEG-5: never a task for a request that does not declare it
        meta = call.params["_meta"]
        token = meta.get("progressToken") if jsonrpc.valid_id(meta.get("progressToken")) else None
        log_level = meta.get(ext.META_LOG_LEVEL) if meta.get(ext.META_LOG_LEVEL) in LOG_LEVELS else None
        events: asyncio.Queue[TaskEvent] = asyncio.Queue()
        streaming = token is not None or log_level is not None
        running = asyncio.ensure_future(
            self.tasks.call(
                call.caller,
                tool=name,
                arguments=arguments,
                mode=mode,
                responses=responses,
                progress_token=token,
                client_capabilities=call.capabilities,
                grace_s=self.grace_s,
                on_event=events.put_nowait if streaming else None,
            )
        )

        def answer(result: CallResult) -> dict[str, Any]:
            return self._call_answer(call, name, arguments, responses, result)

        if streaming:
            # XD-18: progress (and logs, at the level the request asked) of the part inside the
            # request go on its own SSE stream, then the answer; closing the stream cancels the call.
            return Streamed(_call_stream(call.request_id, running, events, log_level, answer))
        await until_done_or_gone(call.scope, receive, running)
        if not running.done():  # X-HTTP-7: the client closed the request, which cancels it
            running.cancel()
            with contextlib.suppress(BaseException):
                await running
            raise asyncio.CancelledError
        return answer(running.result())

    def _call_answer(
        self, call: ModernCall, name: str, arguments: dict[str, Any], responses: dict[str, InputResponse],
        result: CallResult,
    ) -> dict[str, Any]:  # fmt: skip
        if result.task is not None:
            return ext.created(result.task)
        if result.questions:
            return self._input_required(call, name, arguments, responses, result.questions, result.used)
        assert result.outcome is not None
        if result.outcome.kind is OutcomeKind.FAILURE:
            error = error_object(result.outcome)
            status = 400 if error["code"] in HTTP_400_CODES else 200
            raise _fail(error["code"], error["message"], error.get("data"), status=status)
        payload = result.outcome.payload
        return {**ext.call_result(payload), "_meta": {**ext.server_meta(), **(payload.get("_meta") or {})}}

    async def prompts_get(self, call: ModernCall, receive: Receive) -> dict[str, Any]:
        """A prompt that may ask the client first answers like a tool call's round (SEP-2322)."""
        name = _string(call.params, "name")
        prompt = self.registry.prompts.get(name)
        if prompt is None or not prompt.asks:
            return await self._core(call, receive)
        args = {k: str(v) for k, v in (_object(call.params, "arguments") or {}).items()}
        responses = self._with_state(call, f"prompt:{name}", args, _responses(call.params.get("inputResponses")))
        round_ = await self.tasks.ask_first(
            lambda ctx: prompt.render(args, ctx), responses=responses, client_capabilities=call.capabilities
        )
        if round_.questions:
            return self._input_required(call, f"prompt:{name}", args, responses, round_.questions, round_.used)
        out: dict[str, Any] = {"messages": round_.outcome}
        if prompt.description:
            out["description"] = prompt.description
        return ext.complete(out)

    def _input_required(
        self,
        call: ModernCall,
        bound_to: str,
        arguments: dict[str, Any],
        responses: dict[str, InputResponse],
        questions: tuple[PendingInput, ...],
        used: frozenset[str],
    ) -> dict[str, Any]:
        """InputRequiredResult: the questions, and the answers so far sealed in requestState (they
        travel with the client: nothing of the round stays here). Only the answers the run took are
        kept: keys it never asked for do not grow the state round after round."""
        stored = {k: r.to_stored() for k, r in responses.items() if k in used}
        state = self.tasks.request_states.seal(call.caller.principal, bound_to, arguments, stored)
        return {"resultType": "input_required", "inputRequests": ext.input_requests(questions),
                "requestState": state, "_meta": ext.server_meta()}  # fmt: skip

    def _with_state(
        self, call: ModernCall, bound_to: str, arguments: dict[str, Any], responses: dict[str, InputResponse]
    ) -> dict[str, InputResponse]:
        """The answers of earlier rounds, from a valid requestState, under this round's own."""
        state = call.params.get("requestState")
        if state is None:
            return responses
        if not isinstance(state, str):
            raise _fail(INVALID_PARAMS, "params.requestState must be a string")
        earlier = self.tasks.request_states.open(call.caller.principal, bound_to, arguments, state)
        return {**{k: InputResponse.from_stored(v) for k, v in earlier.items() if isinstance(v, dict)}, **responses}

    def _check_param_headers(self, call: ModernCall, schema: dict[str, Any], arguments: dict[str, Any]) -> None:
        """X-HTTP-12: a parameter marked ``x-mcp-header`` is mirrored in ``Mcp-Param-<Name>``."""
        for prop, prop_schema in (schema.get("properties") or {}).items():
            header = prop_schema.get("x-mcp-header") if isinstance(prop_schema, dict) else None
            if not isinstance(header, str) or prop not in arguments:
                continue
            value = _header_value(call.headers.get(f"mcp-param-{header.lower()}"))
            if value is None or value.strip() != str(arguments[prop]):
                raise _fail(ext.HEADER_MISMATCH, f"Header mismatch: Mcp-Param-{header} must equal params.arguments.{prop}",
                            status=400)  # fmt: skip

    async def tasks_get(self, call: ModernCall, _receive: Receive) -> dict[str, Any]:
        task = await self.tasks.get(call.caller, _string(call.params, "taskId"), surface=Surface.EXTENSION)
        pending = await self.tasks.pending_inputs(call.caller, task)
        return ext.complete(ext.detailed(task, pending))

    async def tasks_update(self, call: ModernCall, _receive: Receive) -> dict[str, Any]:
        """X-UPDATE-*, XD-8/9/10: answers by key, all or nothing; unknown keys ignored; ack."""
        task_id = _string(call.params, "taskId")
        _object(call.params, "inputResponses", required=True)
        responses = _responses(call.params["inputResponses"], lenient=True)
        await self.tasks.get(call.caller, task_id, surface=Surface.EXTENSION)  # -32602 for unknown or foreign
        if responses:
            await self.tasks.answer(call.caller, task_id, responses)
        return ext.complete({})

    async def tasks_cancel(self, call: ModernCall, _receive: Receive) -> dict[str, Any]:
        """X-CANCEL-*, XD-7: cancelled before the ack; an ended task's cancel is acknowledged too."""
        with contextlib.suppress(TaskAlreadyTerminal):
            await self.tasks.cancel(call.caller, _string(call.params, "taskId"), surface=Surface.EXTENSION)
        return ext.complete({})

    # --- subscriptions -------------------------------------------------------------------------

    async def listen(self, receive: Receive, send: Send, call: ModernCall) -> None:
        """X-NOTIF-*, XD-14: the ack names only the caller's live tasks; then a snapshot of each,
        then one notification per change, from whichever replica made it."""
        notifications = _object(call.params, "notifications", required=True) or {}
        task_ids = notifications.get("taskIds")
        if task_ids is not None:
            if not isinstance(task_ids, list) or not all(isinstance(t, str) for t in task_ids):
                raise _fail(INVALID_PARAMS, "params.notifications.taskIds must be a list of strings")
            call.require_declaring()  # X-NOTIF-3
            limit = self.settings.max_subscription_task_ids
            if len(task_ids) > limit:
                raise _fail(INVALID_PARAMS, f"at most {limit} taskIds per subscription; split them over several")
        principal = call.caller.principal
        key = (principal.tenant_id, principal.subject, principal.issuer)
        if self.subscriptions.get(key, 0) >= self.settings.max_subscriptions_per_principal:
            raise _fail(
                INVALID_PARAMS,
                f"too many open subscriptions for this principal (at most "
                f"{self.settings.max_subscriptions_per_principal} per replica); close one and retry",
            )
        self.subscriptions[key] = self.subscriptions.get(key, 0) + 1
        try:
            live = []
            ids = list(dict.fromkeys(task_ids or []))
            if ids and (limited := await self.limiter.lookups_blocked(principal)):
                metrics.rate_limited.labels(limited.scope).inc()
                raise RpcFailure(ext.RATE_LIMITED, limited.message, {"retryAfter": limited.retry_after_s},
                                 http_status=429, headers={"Retry-After": str(limited.retry_after_s)})  # fmt: skip
            try:
                for task_id in ids:
                    try:
                        live.append(await self.tasks.get(call.caller, task_id, surface=Surface.EXTENSION))
                    except TaskNotFound:  # dropped from the ack, and counted like any lookup that misses
                        await self.limiter.lookup_missed(principal)
            except DomainError as exc:
                raise to_rpc(exc, modern=True) from None
            meta = {ext.META_SUBSCRIPTION: call.request_id}

            async def messages() -> AsyncIterator[dict[str, Any]]:
                ack: dict[str, Any] = {"notifications": {"taskIds": [t.task_id for t in live]} if task_ids is not None else {},
                                       "_meta": meta}  # fmt: skip
                yield jsonrpc.notification("notifications/subscriptions/acknowledged", ack)
                for task in live:
                    yield await self._task_notification(call, task, meta)
                changes = self.tasks.watch(call.caller, live, poll_s=self.poll_s).__aiter__()
                stop = asyncio.ensure_future(self._until_teardown(principal.expires_at))
                step: asyncio.Future[Any] | None = None
                try:
                    while True:
                        step = asyncio.ensure_future(anext(changes))
                        await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
                        if stop.done():
                            step.cancel()
                            break
                        try:
                            task = step.result()
                        except StopAsyncIteration:  # every task ended: wait for the client or the end
                            await stop
                            break
                        yield await self._task_notification(call, task, meta)
                    # XD-14: a server-side end is a SubscriptionsListenResult, then the stream closes.
                    yield jsonrpc.result_message(call.request_id, {"resultType": "complete", "_meta": meta})
                finally:
                    # The client going away cancels us inside the wait: the pending step must end
                    # before the watch can be closed, or the watch (its subscription and its polls)
                    # would live on.
                    stop.cancel()
                    if step is not None and not step.done():
                        step.cancel()
                        with contextlib.suppress(BaseException):
                            await step
                    with contextlib.suppress(BaseException):
                        await changes.aclose()  # type: ignore[attr-defined]

            await send_sse(send, receive, messages(), keepalive_s=self.keepalive_s)
        finally:
            self.subscriptions[key] -= 1
            if self.subscriptions[key] <= 0:
                del self.subscriptions[key]

    async def _until_teardown(self, expires_at: float | None) -> None:
        """Returns when the subscription must end: the process is shutting down, or the token that
        opened it expired (a stream outliving its credential would keep reporting to nobody)."""
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            timeout = None if expires_at is None else max(0.0, expires_at - time.time())
            await asyncio.wait({closing}, timeout=timeout)
        finally:
            closing.cancel()

    async def _task_notification(self, call: ModernCall, task: Any, meta: dict[str, Any]) -> dict[str, Any]:
        pending = await self.tasks.pending_inputs(call.caller, task)
        return jsonrpc.notification("notifications/tasks", {**ext.detailed(task, pending), "_meta": meta})


@frozen
class Streamed:
    """An answer sent as SSE: notifications, then the response."""

    messages: AsyncIterator[dict[str, Any]]


def _responses(raw: Any, *, lenient: bool = False) -> dict[str, InputResponse]:
    """``inputResponses`` as the core's answers. ``lenient``: a value that is not an object is
    kept as an empty answer, so a key nobody asked is ignored rather than refused (XD-9)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail(INVALID_PARAMS, "params.inputResponses must be an object")
    out: dict[str, InputResponse] = {}
    for key, value in raw.items():
        if not isinstance(value, dict):
            if not lenient:
                raise _fail(INVALID_PARAMS, f"params.inputResponses[{key!r}] must be an object")
            value = {"invalid": value}
        out[key] = InputResponse(result=value)
    return out


async def _call_stream(
    request_id: RequestId,
    running: asyncio.Future[CallResult],
    events: asyncio.Queue[TaskEvent],
    log_level: str | None,
    answer: Callable[[CallResult], dict[str, Any]],
) -> AsyncIterator[dict[str, Any]]:
    try:
        while True:
            getter: asyncio.Future[TaskEvent] = asyncio.ensure_future(events.get())
            waiting: set[asyncio.Future[Any]] = {running, getter}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                message = _event_notification(getter.result(), log_level)
                if message is not None:
                    yield message
                continue
            getter.cancel()
            break
        while not events.empty():
            message = _event_notification(events.get_nowait(), log_level)
            if message is not None:
                yield message
        try:
            yield jsonrpc.result_message(request_id, answer(running.result()))
        except RpcFailure as failure:
            yield jsonrpc.error_message(request_id, failure.error_object())
        except DomainError as exc:
            yield jsonrpc.error_message(request_id, to_rpc(exc, modern=True).error_object())
    finally:
        if not running.done():  # the client closed the stream: the call is cancelled (X-HTTP-7)
            running.cancel()
            with contextlib.suppress(BaseException):
                await running


def _event_notification(event: TaskEvent, log_level: str | None) -> dict[str, Any] | None:
    if isinstance(event, LogEntry) and log_level is None:
        return None  # no logs unless the request asked for them (its _meta logLevel)
    if isinstance(event, Progress | LogEntry):
        return event_message(event, None, log_level)
    return None
