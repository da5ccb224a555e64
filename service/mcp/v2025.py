"""MCP methods for sessions negotiated at 2025-11-25 (Tasks) and older revisions (plain tools)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from service import __version__
from service.domain.errors import CapacityExceeded, DomainError, TaskNotFound
from service.domain.events import LOG_LEVELS, Finished, SessionEvent, TaskEvent
from service.domain.principal import Caller, Principal
from service.domain.values import frozen
from service.guard.ratelimit import RateLimiter
from service.mcp import jsonrpc
from service.mcp.catalog import Catalog
from service.mcp.jsonrpc import INVALID_PARAMS, METHOD_NOT_FOUND, RATE_LIMITED, RequestId
from service.mcp.plain import CallKey, Inflight, Outbox, PlainCallContext, first_of
from service.mcp.refusal import Refusal, from_domain
from service.mcp.v2025_wire import (
    event_message,
    outcome_result,
    progress_token_of,
    related,
    task_result,
    task_to_wire,
    task_ttl_of,
)
from service.observability import metrics
from service.tasks.audit import AuditLog
from service.tasks.service import TaskService
from service.tasks.sessions import Session, SessionService
from service.tools.registry import Registry

LATEST = "2025-11-25"
SUPPORTED_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26")
TASK_VERSIONS = frozenset({"2025-11-25"})
LOOKUPS = frozenset({"tasks/get", "tasks/result", "tasks/cancel"})
# tasks/result of a task still running waits this long for it to end before answering as a stream.
RESULT_GRACE_S = 1.0


@frozen
class Call:
    caller: Caller
    session: Session | None
    request_id: RequestId
    params: dict[str, Any]

    @property
    def principal(self) -> Principal:
        return self.caller.principal

    @property
    def version(self) -> str:
        return self.session.protocol_version if self.session else LATEST

    @property
    def tasks_enabled(self) -> bool:
        return self.version in TASK_VERSIONS

    @property
    def cancel_key(self) -> CallKey:
        """How notifications/cancelled names this request: same tenant, session and id."""
        session_id = self.session.session_id if self.session else ""
        return (self.principal.tenant_id, session_id, repr(self.request_id))


@frozen
class Streamed:
    """A reply sent as SSE: messages first, the JSON-RPC response last (or none if cancelled).

    ``cancel_key`` lets notifications/cancelled end the stream without a response (C-9)."""

    messages: AsyncIterator[dict[str, Any]]
    cancel_key: CallKey | None = None


Reply = dict[str, Any] | Streamed


def _str_param(params: dict[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str):
        raise Refusal(INVALID_PARAMS, f"params.{name} must be a string" if name in params else f"missing params.{name}")
    return value


class V2025Surface:
    def __init__(
        self,
        tasks: TaskService,
        sessions: SessionService,
        registry: Registry,
        inflight: Inflight,
        limiter: RateLimiter,
        audit: AuditLog,
        *,
        poll_s: float,
        result_grace_s: float = RESULT_GRACE_S,
    ) -> None:
        self.result_grace_s = result_grace_s
        self.tasks = tasks
        self.sessions = sessions
        self.limiter = limiter
        self.audit = audit
        self.registry = registry
        self.catalog = Catalog(registry)
        self.inflight = inflight
        self.poll_s = poll_s
        self._methods = {
            "ping": self.ping,
            "tools/list": self.tools_list,
            "tools/call": self.tools_call,
            "tasks/get": self.tasks_get,
            "tasks/result": self.tasks_result,
            "tasks/list": self.tasks_list,
            "tasks/cancel": self.tasks_cancel,
            "resources/list": self._catalogued(self.catalog.resources_list),
            "resources/templates/list": self._catalogued(self.catalog.resource_templates_list),
            "resources/read": self._catalogued(self.catalog.resources_read),
            "resources/subscribe": self.ping,
            "resources/unsubscribe": self.ping,
            "prompts/list": self._catalogued(self.catalog.prompts_list),
            "prompts/get": self._catalogued(self.catalog.prompts_get),
            "logging/setLevel": self.set_log_level,
            "completion/complete": self._catalogued(self.catalog.completion_complete),
        }

    # --- lifecycle -------------------------------------------------------------------------

    def negotiate(self, params: dict[str, Any]) -> str:
        """T-CAP-10: the client's version if supported, else our latest."""
        requested = params.get("protocolVersion")
        if not isinstance(requested, str):
            raise Refusal(INVALID_PARAMS, "params.protocolVersion must be a string")
        if not isinstance(params.get("capabilities", {}), dict):
            raise Refusal(INVALID_PARAMS, "params.capabilities must be an object")
        return requested if requested in SUPPORTED_VERSIONS else LATEST

    def initialize_result(self, version: str) -> dict[str, Any]:
        caps: dict[str, Any] = {"tools": {"listChanged": self.registry.may_change}, "logging": {}}
        if self.registry.resources:
            caps["resources"] = {"subscribe": True, "listChanged": False}
        if self.registry.prompts:
            caps["prompts"] = {"listChanged": False}
            caps["completions"] = {}
        if version in TASK_VERSIONS:
            caps["tasks"] = {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
        return {
            "protocolVersion": version,
            "capabilities": caps,
            "serverInfo": {"name": "mcp-task-service", "title": "MCP Task Service", "version": __version__},
            "instructions": "Long-running tools run as durable tasks: call with params.task, then poll tasks/get.",
        }

    @staticmethod
    def _catalogued(handler: Callable[[dict[str, Any]], Awaitable[Reply]]) -> Callable[[Call], Awaitable[Reply]]:
        async def answer(call: Call) -> Reply:
            return await handler(call.params)

        return answer

    async def dispatch(self, method: str, call: Call) -> Reply:
        handler = self._methods.get(method)
        if handler is None or (method.startswith("tasks/") and not call.tasks_enabled):
            raise Refusal(METHOD_NOT_FOUND, f"method not found: {method}")
        lookup = method in LOOKUPS
        if lookup and (limited := await self.limiter.lookups_blocked(call.principal)):
            # T-SEC-11: too many lookups of ids that do not exist (or are not yours) look like enumeration.
            await self.audit.deny(call.caller, "rate_limited", scope=limited.scope)
            metrics.rate_limited.labels(limited.scope).inc()
            metrics.denied("not_found", call.principal.tenant_id)
            raise Refusal(
                RATE_LIMITED,
                limited.message,
                {"retryAfter": limited.retry_after_s},
                status=429,
                headers={"Retry-After": str(limited.retry_after_s)},
            )
        try:
            return await handler(call)
        except TaskNotFound as exc:
            if lookup:
                await self.limiter.lookup_missed(call.principal)
            raise from_domain(exc) from None
        except CapacityExceeded as exc:
            metrics.cap_refusals.labels(str(exc.details.get("scope", ""))).inc()
            metrics.denied("cap", call.principal.tenant_id)
            raise from_domain(exc) from None
        except DomainError as exc:
            raise from_domain(exc) from None

    async def ping(self, call: Call) -> Reply:
        return {}

    async def set_log_level(self, call: Call) -> Reply:
        level = _str_param(call.params, "level")
        if level not in LOG_LEVELS:
            raise Refusal(INVALID_PARAMS, f"level must be one of {', '.join(LOG_LEVELS)}")
        if call.session is not None:
            await self.sessions.set_log_level(call.principal, call.session.session_id, level)
        return {}

    # --- tools -----------------------------------------------------------------------------

    async def tools_list(self, call: Call) -> Reply:
        with_execution = call.tasks_enabled
        return {"tools": [t.to_wire(with_execution=with_execution) for t in self.registry.tools.values()]}

    async def tools_call(self, call: Call) -> Reply:
        params = call.params
        name = _str_param(params, "name")
        arguments = params.get("arguments", {})
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise Refusal(INVALID_PARAMS, "params.arguments must be an object")
        token = progress_token_of(params)
        caps = call.session.client_capabilities if call.session else {}
        # T-CAP-5: params.task is ignored where tasks were not negotiated.
        if call.tasks_enabled and "task" in params:
            task = await self.tasks.create(
                call.caller,
                tool=name,
                arguments=arguments,
                ttl_ms=task_ttl_of(params["task"]),
                progress_token=token,
                session_id=call.session.session_id if call.session else None,
                client_capabilities=caps,
            )
            # D-5: the CreateTaskResult carries related-task metadata.
            return {"task": task_to_wire(task), "_meta": related(task.task_id)}
        # Sessions below 2025-11-25 cannot augment, so taskSupport does not bind them.
        spec, valid = self.tasks.check_call(name, arguments, as_task=False, negotiate=call.tasks_enabled)
        return await self._run_plain(call, spec.name, valid, token, caps)

    async def _run_plain(
        self, call: Call, name: str, arguments: dict[str, Any], token: str | int | None, caps: dict[str, Any]
    ) -> Reply:
        """Answer JSON when the tool finishes before saying anything; otherwise switch to SSE."""
        outbox = Outbox()
        ctx = PlainCallContext(
            self.inflight,
            call.principal.owner_key,
            outbox,
            progress_token=token,
            client_capabilities=caps,
        )
        try:
            job = await self.tasks.start_plain(call.caller, name, arguments, ctx)
        except DomainError as exc:
            raise from_domain(exc) from None
        # Most calls end in their first step, and need no cancel hook, no wait.
        if not job.done():
            key = call.cancel_key
            self.inflight.calls[key] = job.cancel
            job.add_done_callback(lambda _j: self.inflight.calls.pop(key, None))
            await first_of(job, outbox)
        if job.done() and outbox.empty():
            if job.cancelled():
                return Streamed(_nothing())
            return outcome_result(job.result())
        first = asyncio.ensure_future(outbox.get())
        log_level = call.session.log_level if call.session else None

        async def stream() -> AsyncIterator[dict[str, Any]]:
            pending: set[asyncio.Future[Any]] = {first, job}
            getter: asyncio.Future[Any] = first
            try:
                while True:
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    if getter in done:
                        if (message := event_message(getter.result(), None, log_level)) is not None:
                            yield message
                        pending.discard(getter)
                        getter = asyncio.ensure_future(outbox.get())
                        pending.add(getter)
                        continue
                    while not outbox.empty():
                        if (message := event_message(outbox.get_nowait(), None, log_level)) is not None:
                            yield message
                    if job.cancelled():
                        return  # C-4: a cancelled request gets no response
                    try:
                        yield jsonrpc.result_message(call.request_id, outcome_result(job.result()))
                    except Refusal as failure:
                        yield jsonrpc.error_message(call.request_id, failure.error_object())
                    return
            finally:
                getter.cancel()

        return Streamed(stream())

    # --- tasks -----------------------------------------------------------------------------

    async def tasks_get(self, call: Call) -> Reply:
        return task_to_wire(await self.tasks.get(call.caller, _str_param(call.params, "taskId")))

    async def tasks_cancel(self, call: Call) -> Reply:
        return task_to_wire(await self.tasks.cancel(call.caller, _str_param(call.params, "taskId")))

    async def tasks_list(self, call: Call) -> Reply:
        cursor = call.params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise Refusal(INVALID_PARAMS, "params.cursor must be a string")
        tasks, next_cursor = await self.tasks.list_page(call.caller, cursor)
        out: dict[str, Any] = {"tasks": [task_to_wire(t) for t in tasks]}
        if next_cursor:
            out["nextCursor"] = next_cursor
        return out

    async def tasks_result(self, call: Call) -> Reply:
        """T-RES-3: block until terminal. Answer JSON if it already is; else SSE carrying the
        task's requests to the client (elicitation), its notices, and finally the result."""
        task_id = _str_param(call.params, "taskId")
        # Watching from before the read, so the stream goes on from this read (no second one).
        watch = self.tasks.streams.watch_task(call.caller, task_id)
        try:
            task = await self.tasks.retrieve(call.caller, task_id)  # audits the hand-out when terminal
        except BaseException:
            watch.close()
            raise
        if task.status.is_terminal:
            watch.close()
            return task_result(task)
        # Like a plain call: answer JSON if the task ends before there is anything to stream.
        events = self.tasks.streams.follow(call.caller, task_id, poll_s=self.poll_s, opened=(watch, task))
        first: asyncio.Task[TaskEvent] = asyncio.ensure_future(anext(events))
        # A stream cancelled before its first step never runs its own clean-up: closed here too.
        first.add_done_callback(lambda _f: watch.close() if _f.cancelled() else None)
        key = call.cancel_key
        stop = first.cancel
        self.inflight.calls[key] = stop  # notifications/cancelled during the wait (C-4)
        try:
            with metrics.waiting_for_task():  # a latency SLO measures the service, not the tool
                await asyncio.wait({first}, timeout=self.result_grace_s)
        except BaseException:  # this request was cancelled (client gone, shutdown): stop following
            first.cancel()
            await asyncio.wait({first})
            await events.aclose()  # type: ignore[attr-defined]
            raise
        finally:
            if self.inflight.calls.get(key) == stop:
                del self.inflight.calls[key]
        if first.done() and (
            first.cancelled() or first.exception() is not None or isinstance(first.result(), Finished)
        ):
            await events.aclose()  # type: ignore[attr-defined]
            if first.cancelled():
                return Streamed(_nothing())  # C-4: a cancelled request gets no response
            event = first.result()  # raises the lookup's error, if any
            assert isinstance(event, Finished)
            return task_result(event.task)
        return Streamed(self._follow(call, first, events), cancel_key=key)

    async def _follow(
        self, call: Call, first: asyncio.Task[TaskEvent], events: AsyncIterator[TaskEvent]
    ) -> AsyncIterator[dict[str, Any]]:
        try:
            with metrics.waiting_for_task():  # the stream lasts as long as the task: not our latency
                event = await first
                if (message := self.follow_message(call, event)) is not None:
                    yield message
                if not isinstance(event, Finished):
                    async for event in events:
                        if (message := self.follow_message(call, event)) is not None:
                            yield message
        except DomainError as exc:
            yield jsonrpc.error_message(call.request_id, from_domain(exc).error_object())
        finally:
            if not first.done():
                first.cancel()
                await asyncio.wait({first})
            await events.aclose()  # type: ignore[attr-defined]

    @staticmethod
    def follow_message(call: Call, event: SessionEvent) -> dict[str, Any] | None:
        return event_message(event, call.request_id, call.session.log_level if call.session else None)


async def _nothing() -> AsyncIterator[dict[str, Any]]:
    """An SSE reply with no messages: the stream of a request cancelled before it said anything."""
    messages: tuple[dict[str, Any], ...] = ()
    for message in messages:
        yield message
