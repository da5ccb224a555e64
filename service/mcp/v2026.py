"""The 2026-07-28 wire: stateless requests, per-request `_meta`, and the Tasks extension.

Every request carries its protocol version and client capabilities in ``params._meta`` and names its
method (and, for ``tasks/*``, its task) in headers; nothing is remembered between requests, so any
replica serves any request. Tasks are the same rows as on 2025-11-25, rendered here by the
extension's rules (docs/decisions.md lists the XD-* choices). Calls are ``v2026_calls.py``'s,
subscriptions ``v2026_listen.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from service.config import Settings
from service.domain.errors import CapacityExceeded, DomainError, TaskAlreadyTerminal, TaskNotFound
from service.domain.principal import Caller
from service.domain.task import Wire
from service.guard.ratelimit import RateLimiter
from service.mcp import jsonrpc
from service.mcp import v2026_wire as ext
from service.mcp.framing import check_client_data
from service.mcp.http import send_json
from service.mcp.jsonrpc import INVALID_PARAMS, METHOD_NOT_FOUND, RequestId
from service.mcp.refusal import Refusal, answer, from_domain, http_refusal
from service.mcp.sse import StreamsClosing, send_sse
from service.mcp.traced import request_failed, request_span
from service.mcp.v2025 import V2025Surface
from service.mcp.v2026_calls import V2026Calls, responses_of
from service.mcp.v2026_listen import Subscriptions
from service.mcp.v2026_request import (
    CACHE_HINT,
    LOOKUPS,
    METHOD_HEADER,
    NAME_HEADER,
    NAMED,
    RESOURCE_NOT_FOUND,
    TASK_METHODS,
    Streamed,
    V2026Call,
    duplicated_routing_header,
    fail,
    header_value,
    object_param,
    string_param,
)
from service.observability import logging as logctx
from service.observability import metrics
from service.tasks.audit import AuditLog
from service.tasks.service import TaskService


class V2026Surface:
    def __init__(
        self, settings: Settings, tasks: TaskService, v2025: V2025Surface, limiter: RateLimiter, audit: AuditLog,
        streams: StreamsClosing | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.tasks = tasks
        self.v2025 = v2025
        self.registry = v2025.registry
        self.limiter = limiter
        self.audit = audit
        self.keepalive_s = settings.sse_keepalive_ms / 1000
        self.calls = V2026Calls(tasks, grace_s=settings.task_grace_ms / 1000, core=self._core)
        self.listening = Subscriptions(settings, tasks, limiter, audit)
        self.streams = streams if streams is not None else StreamsClosing()
        self.listening.closing = self.streams.begun  # subscriptions end when a shutdown begins (XD-14)
        self._methods = {
            "server/discover": self.discover,
            "tools/list": self.tools_list,
            "tools/call": self.calls.tools_call,
            "tasks/get": self.tasks_get,
            "tasks/update": self.tasks_update,
            "tasks/cancel": self.tasks_cancel,
            "resources/list": self._core,
            "resources/templates/list": self._core,
            "resources/read": self._core,
            "prompts/list": self._core,
            "prompts/get": self.calls.prompts_get,
            "completion/complete": self._core,
        }

    # --- the envelope --------------------------------------------------------------------------

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers, caller: Caller, message: dict[str, Any]
    ) -> None:
        if "method" not in message:
            raise http_refusal(400, "2026-07-28 clients send no responses (X-HTTP-8)")
        method = message["method"]
        if not isinstance(method, str):
            raise http_refusal(400, "Invalid Request: method must be a string")
        if "id" not in message:
            await send_json(send, 202, None)  # notifications: accepted, nothing to do (X-CANCEL-6)
            return
        request_id = message["id"]
        if not jsonrpc.valid_id(request_id):
            raise http_refusal(400, "Invalid Request: id must be a string or an integer")
        if jsonrpc.id_too_long(request_id):
            raise http_refusal(400, f"Invalid Request: id is longer than {jsonrpc.MAX_ID_CHARS} characters")
        label = metrics.method(method)
        logctx.note_method(label)
        started = time.perf_counter()
        outcome = "error"
        code: int | None = None
        with request_span(label, message, headers, caller, protocol_version=ext.VERSION):
            try:
                handler = self._methods.get(method)
                if handler is None and method != "subscriptions/listen":
                    # X-HTTP-5: tasks/result, tasks/list, initialize, ping... do not exist here; said first.
                    raise fail(METHOD_NOT_FOUND, f"Method not found: {method}", status=404)
                call = self._envelope(scope, caller, request_id, method, message.get("params"), headers)
                if handler is None:
                    await self.listening.listen(receive, send, call)
                    outcome = "ok"
                    return
                reply = await self._dispatch(handler, call, receive)
                outcome = "ok"
                if isinstance(reply, Streamed):
                    await send_sse(
                        send, receive, reply.messages, keepalive_s=self.keepalive_s, stop=self.streams.deadline
                    )
                    return
            except Refusal as failure:
                code = failure.code
                if failure.envelope:  # answered by the endpoint, without this request's id
                    raise
                failure.request_id = request_id
                await answer(send, failure)
                return
            finally:
                request_failed(code, outcome)
                if outcome != "ok":
                    metrics.labelled(metrics.request_errors, label, metrics.rpc_code(code), ext.VERSION).inc()
                metrics.request_meter.record(label, outcome, ext.VERSION, time.perf_counter() - started)
            await send_json(send, 200, jsonrpc.result_message(request_id, reply))

    def _envelope(
        self, scope: Scope, caller: Caller, request_id: RequestId, method: str, params: Any, headers: Headers
    ) -> V2026Call:
        """§1, §10, §14.1: the headers match the body; `_meta` names this version and the capabilities."""
        if (twice := duplicated_routing_header(headers)) is not None:
            raise fail(ext.HEADER_MISMATCH, f"Header duplicated: {twice} (send each routing header once)",
                       {"header": twice}, status=400)  # fmt: skip
        sent = headers.get(METHOD_HEADER)
        if sent is None:
            raise fail(ext.HEADER_MISMATCH, f"Header missing: Mcp-Method (it must be sent and equal the request's method, "
                       f"{method!r}; X-HTTP-1)", {"header": "Mcp-Method", "expected": method}, status=400)  # fmt: skip
        if sent != method:
            raise fail(ext.HEADER_MISMATCH, "Header mismatch: Mcp-Method must equal the request's method", status=400)
        if not isinstance(params, dict):
            raise fail(INVALID_PARAMS, "params must be an object with _meta (2026-07-28)", status=400)
        meta = params.get("_meta")
        if not isinstance(meta, dict):
            raise fail(INVALID_PARAMS, "params._meta is required on 2026-07-28 (protocolVersion, clientCapabilities)",
                        status=400)  # fmt: skip
        version = meta.get(ext.META_VERSION)
        if version is None:
            raise fail(INVALID_PARAMS, f"missing _meta[{ext.META_VERSION!r}]", status=400)
        if version != ext.VERSION:
            raise fail(ext.HEADER_MISMATCH, "Header mismatch: MCP-Protocol-Version differs from _meta's protocolVersion",
                        status=400)  # fmt: skip
        capabilities = meta.get(ext.META_CAPABILITIES)
        if not isinstance(capabilities, dict):
            raise fail(INVALID_PARAMS, f"_meta[{ext.META_CAPABILITIES!r}] must be an object", status=400)
        try:
            check_client_data(ext.META_CAPABILITIES, capabilities, self.settings.max_client_capabilities_bytes)
            check_client_data(ext.META_CLIENT_INFO, meta.get(ext.META_CLIENT_INFO), self.settings.max_client_info_bytes)
        except Refusal as too_big:
            too_big.status = 400  # as every other malformed _meta
            raise
        extensions = capabilities.get("extensions")
        if extensions is not None and not isinstance(extensions, dict):
            raise fail(INVALID_PARAMS, "clientCapabilities.extensions must be an object", status=400)
        if (
            isinstance(extensions, dict)
            and ext.EXTENSION in extensions
            and not isinstance(extensions[ext.EXTENSION], dict)
        ):
            raise fail(INVALID_PARAMS, f"clientCapabilities.extensions[{ext.EXTENSION!r}] must be an object (XD-23)",
                        status=400)  # fmt: skip
        call = V2026Call(caller, request_id, method, params, capabilities, headers, scope)
        if method in TASK_METHODS:
            task_id = params.get("taskId")
            name = header_value(headers.get(NAME_HEADER))
            if name is None:
                # docs/decisions.md, "A missing Mcp-Name": refused as the spec says, saying so.
                raise fail(ext.HEADER_MISMATCH, f"Header missing: Mcp-Name (a {method} request must send it, equal to "
                           "params.taskId, X-HTTP-1; the task is unchanged: send the header and retry)",
                           {"header": "Mcp-Name", "expected": task_id}, status=400)  # fmt: skip
            if name != task_id:
                raise fail(ext.HEADER_MISMATCH, "Header mismatch: Mcp-Name must equal params.taskId", status=400)
            call.require_declaring()  # X-GET-9: before the lookup
        elif method in NAMED:
            field, required = NAMED[method]
            name = header_value(headers.get(NAME_HEADER))
            if name is None and required:
                raise fail(ext.HEADER_MISMATCH, f"Header missing: Mcp-Name (a {method} request must send it, equal to "
                           f"params.{field}, X-HTTP-1)", {"header": "Mcp-Name"}, status=400)  # fmt: skip
            if name is not None and name.strip() != params.get(field):
                raise fail(ext.HEADER_MISMATCH, f"Header mismatch: Mcp-Name must equal params.{field}", status=400)
        return call

    async def _dispatch(self, handler: Any, call: V2026Call, receive: Receive) -> dict[str, Any] | Streamed:
        lookup = call.method in LOOKUPS
        if lookup and (limited := await self.limiter.lookups_blocked(call.caller.principal)):
            await self.audit.deny(call.caller, "rate_limited", scope=limited.scope)
            metrics.rate_limited.labels(limited.scope).inc()
            metrics.denied("not_found", call.caller.principal.tenant_id)
            raise Refusal(ext.RATE_LIMITED, limited.message, {"retryAfter": limited.retry_after_s}, status=429,
                             headers={"Retry-After": str(limited.retry_after_s)})  # fmt: skip
        try:
            result: dict[str, Any] | Streamed = await handler(call, receive)
            return result
        except TaskNotFound as exc:
            if lookup:
                await self.limiter.lookup_missed(call.caller.principal)
            raise from_domain(exc, wire=Wire.V2026) from None
        except CapacityExceeded as exc:
            metrics.cap_refusals.labels(str(exc.details.get("scope", ""))).inc()
            metrics.denied("cap", call.caller.principal.tenant_id)
            raise from_domain(exc, wire=Wire.V2026) from None
        except DomainError as exc:
            raise from_domain(exc, wire=Wire.V2026) from None

    # --- methods -------------------------------------------------------------------------------

    async def discover(self, call: V2026Call, _receive: Receive) -> dict[str, Any]:
        """X-NEG-1/2/3, XD-19, XD-24."""
        capabilities: dict[str, Any] = {
            "tools": {"listChanged": self.registry.may_change},
            "extensions": {ext.EXTENSION: {}},
        }
        if self.registry.resources:
            capabilities["resources"] = {"subscribe": False, "listChanged": False}
        if self.registry.prompts:
            capabilities["prompts"] = {"listChanged": False}
            capabilities["completions"] = {}
        return ext.complete(
            {
                "supportedVersions": [ext.VERSION, "2025-11-25"],
                "capabilities": capabilities,
                "ttlMs": 300_000,
                "cacheScope": "private",
                "instructions": "Long-running tools may answer with a task: poll tasks/get, answer input with "
                "tasks/update, or subscribe with subscriptions/listen.",
            }
        )

    async def tools_list(self, call: V2026Call, _receive: Receive) -> dict[str, Any]:
        tools = [t.to_wire(with_execution=False) for t in self.registry.tools.values()]
        return ext.complete({"tools": tools, **CACHE_HINT})

    async def _core(self, call: V2026Call, _receive: Receive) -> dict[str, Any]:
        """Resources, prompts and completion: the same handlers as 2025-11-25, in 2026-07-28 form."""
        from service.mcp.v2025 import Call

        params = {k: v for k, v in call.params.items() if k != "_meta"}
        try:
            reply = await self.v2025.dispatch(call.method, Call(call.caller, None, call.request_id, params))
        except Refusal as failure:
            if failure.code == RESOURCE_NOT_FOUND:  # 2026-07-28 says -32602 (SEP-2164), with the uri
                raise fail(INVALID_PARAMS, failure.message, failure.data) from None
            raise
        assert isinstance(reply, dict)
        if call.method in ("resources/list", "resources/templates/list", "resources/read", "prompts/list"):
            reply = {**reply, **CACHE_HINT}
        return ext.complete(reply)

    async def tasks_get(self, call: V2026Call, _receive: Receive) -> dict[str, Any]:
        task_id = string_param(call.params, "taskId")
        task = await self.tasks.get(call.caller, task_id, wire=Wire.V2026)
        if task.status.is_terminal:  # its result or error goes out inline: a hand-out, audited (issue 42 §5)
            task = await self.tasks.retrieve(call.caller, task_id, wire=Wire.V2026)
        pending = await self.tasks.pending_inputs(call.caller, task)
        return ext.complete(ext.detailed(task, pending))

    async def tasks_update(self, call: V2026Call, _receive: Receive) -> dict[str, Any]:
        """X-UPDATE-*, XD-8/9/10: answers by key, all or nothing; unknown keys ignored; ack."""
        task_id = string_param(call.params, "taskId")
        object_param(call.params, "inputResponses", required=True)
        responses = responses_of(call.params["inputResponses"], lenient=True)
        await self.tasks.get(call.caller, task_id, wire=Wire.V2026)  # -32602 for unknown or foreign
        if responses:
            await self.tasks.answer(call.caller, task_id, responses)
        return ext.complete({})

    async def tasks_cancel(self, call: V2026Call, _receive: Receive) -> dict[str, Any]:
        """X-CANCEL-*, XD-7: cancelled before the ack; an ended task's cancel is acknowledged too."""
        with contextlib.suppress(TaskAlreadyTerminal):
            await self.tasks.cancel(call.caller, string_param(call.params, "taskId"), wire=Wire.V2026)
        return ext.complete({})

    @property
    def closing(self) -> asyncio.Event:
        """Set when the process starts to shut down: open subscriptions end gracefully (XD-14)."""
        return self.listening.closing
