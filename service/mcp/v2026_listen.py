"""subscriptions/listen of the 2026-07-28 wire (X-NOTIF-*, XD-14): an ack naming the caller's live
tasks, a snapshot of each, then one notification per change, from whichever replica made it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import Receive, Send

from service.config import Settings
from service.domain.errors import DomainError, TaskNotFound
from service.domain.task import Task, Wire
from service.guard.ratelimit import RateLimiter
from service.mcp import jsonrpc
from service.mcp import v2026_wire as ext
from service.mcp.jsonrpc import INVALID_PARAMS
from service.mcp.refusal import Refusal, from_domain
from service.mcp.sse import send_sse
from service.mcp.v2026_request import V2026Call, fail, object_param
from service.observability import metrics
from service.tasks.audit import AuditLog
from service.tasks.service import TaskService


class Subscriptions:
    """The open subscriptions of this process, per principal (at most a settable number each)."""

    def __init__(self, settings: Settings, tasks: TaskService, limiter: RateLimiter, audit: AuditLog) -> None:
        self.settings = settings
        self.tasks = tasks
        self.limiter = limiter
        self.audit = audit
        self.poll_s = settings.poll_interval_ms / 1000
        self.keepalive_s = settings.sse_keepalive_ms / 1000
        self.open: dict[tuple[str, str, str], int] = {}
        # Set when the process starts to shut down: open subscriptions end gracefully (XD-14).
        self.closing = asyncio.Event()

    async def listen(self, receive: Receive, send: Send, call: V2026Call) -> None:
        """X-NOTIF-*, XD-14: the ack names only the caller's live tasks; then a snapshot of each,
        then one notification per change, from whichever replica made it."""
        notifications = object_param(call.params, "notifications", required=True) or {}
        task_ids = notifications.get("taskIds")
        if task_ids is not None:
            if not isinstance(task_ids, list) or not all(isinstance(t, str) for t in task_ids):
                raise fail(INVALID_PARAMS, "params.notifications.taskIds must be a list of strings")
            call.require_declaring()  # X-NOTIF-3
            limit = self.settings.max_subscription_task_ids
            if len(task_ids) > limit:
                raise fail(INVALID_PARAMS, f"at most {limit} taskIds per subscription; split them over several")
        tools_wanted = notifications.get("toolsListChanged", False)
        if not isinstance(tools_wanted, bool):
            raise fail(INVALID_PARAMS, "params.notifications.toolsListChanged must be a boolean")
        principal = call.caller.principal
        key = (principal.tenant_id, principal.subject, principal.issuer)
        if self.open.get(key, 0) >= self.settings.max_subscriptions_per_principal:
            raise fail(
                INVALID_PARAMS,
                f"too many open subscriptions for this principal (at most "
                f"{self.settings.max_subscriptions_per_principal} per replica); close one and retry",
            )
        self.open[key] = self.open.get(key, 0) + 1
        try:
            live = []
            ids = list(dict.fromkeys(task_ids or []))
            try:
                for task_id in ids:  # each id a lookup: one that misses spends the not-found budget
                    if limited := await self.limiter.lookups_blocked(principal):
                        metrics.rate_limited.labels(limited.scope).inc()
                        await self.audit.deny(call.caller, "rate_limited", scope=limited.scope)
                        raise Refusal(ext.RATE_LIMITED, limited.message, {"retryAfter": limited.retry_after_s},
                                      status=429, headers={"Retry-After": str(limited.retry_after_s)})  # fmt: skip
                    try:
                        live.append(await self.tasks.get(call.caller, task_id, wire=Wire.V2026))
                    except TaskNotFound:  # dropped from the ack, and counted like any lookup that misses
                        await self.limiter.lookup_missed(principal)
            except DomainError as exc:
                raise from_domain(exc, wire=Wire.V2026) from None
            meta = {ext.META_SUBSCRIPTION: call.request_id}
            agreed: dict[str, Any] = {} if task_ids is None else {"taskIds": [t.task_id for t in live]}
            if tools_wanted and self.tasks.registry.may_change:  # only what this server sends
                agreed["toolsListChanged"] = True
            messages = self._messages(call, live, agreed, meta)
            await send_sse(send, receive, messages, keepalive_s=self.keepalive_s)
        finally:
            self.open[key] -= 1
            if self.open[key] <= 0:
                del self.open[key]

    async def _messages(
        self, call: V2026Call, live: list[Task], agreed: dict[str, Any], meta: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        """The ack, a snapshot of each live task, then a notification per change of a task (and of
        the tool list, if agreed) until the subscription ends."""
        yield jsonrpc.notification("notifications/subscriptions/acknowledged", {"notifications": agreed, "_meta": meta})
        for task in live:
            yield await self._task_notification(call, task, meta)
        changes = self.tasks.streams.watch(call.caller, live, poll_s=self.poll_s).__aiter__()
        scope = contextlib.AsyncExitStack()
        tools_changed = None
        if agreed.get("toolsListChanged"):
            tools_changed = await scope.enter_async_context(self.tasks.streams.tool_changes())
        stop = asyncio.ensure_future(self._until_teardown(call.caller.principal.expires_at))
        step: asyncio.Future[Any] | None = None
        tool_step: asyncio.Future[Any] | None = None
        watching = True
        try:
            while True:
                if watching and step is None:
                    step = asyncio.ensure_future(anext(changes))
                if tools_changed is not None and tool_step is None:
                    tool_step = asyncio.ensure_future(tools_changed())
                await asyncio.wait({f for f in (step, tool_step, stop) if f is not None},
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if stop.done():
                    break
                if tool_step is not None and tool_step.done():
                    yield jsonrpc.notification("notifications/tools/list_changed", {"_meta": meta})
                    tool_step = None
                if step is not None and step.done():
                    try:
                        task = step.result()
                    except StopAsyncIteration:  # every task ended: only the tools, the client or the end
                        watching = False
                    else:
                        yield await self._task_notification(call, task, meta)
                    step = None
            # XD-14: a server-side end is a SubscriptionsListenResult, then the stream closes.
            yield jsonrpc.result_message(call.request_id, {"resultType": "complete", "_meta": meta})
        finally:
            # The client going away cancels us inside the wait: the pending steps must end before
            # the watch can be closed, or the watch (its subscription and its polls) would live on.
            stop.cancel()
            for pending in (step, tool_step):
                if pending is not None and not pending.done():
                    pending.cancel()
                    with contextlib.suppress(BaseException):
                        await pending
            with contextlib.suppress(BaseException):
                await changes.aclose()  # type: ignore[attr-defined]
            await scope.aclose()

    async def _until_teardown(self, expires_at: float | None) -> None:
        """Returns when the subscription must end: the process is shutting down, or the token that
        opened it expired (a stream outliving its credential would keep reporting to nobody)."""
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            timeout = None if expires_at is None else max(0.0, expires_at - time.time())
            await asyncio.wait({closing}, timeout=timeout)
        finally:
            closing.cancel()

    async def _task_notification(self, call: V2026Call, task: Task, meta: dict[str, Any]) -> dict[str, Any]:
        if task.status.is_terminal:  # its result or error goes out inline: a hand-out, audited (issue 42 §5)
            with contextlib.suppress(TaskNotFound):  # gone meanwhile: what was read is what is sent
                task = await self.tasks.retrieve(call.caller, task.task_id, wire=Wire.V2026)
        pending = await self.tasks.pending_inputs(call.caller, task)
        return jsonrpc.notification("notifications/tasks", {**ext.detailed(task, pending), "_meta": meta})
