"""TaskService: the rules of the task lifecycle, for every wire alike.

It speaks domain records only: tasks, typed events (``service.domain.events``) and pending inputs
``(key, kind, params)`` answered by key. The edge (``service.mcp``) renders them for each wire.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from typing import Any

from service.domain.errors import (
    CapacityExceeded,
    InvalidArguments,
    TaskAlreadyTerminal,
    TaskNotFound,
    TaskSupportMismatch,
    Unavailable,
)
from service.domain.events import (
    TaskEvent,
)
from service.domain.inputs import InputResponse, PendingInput
from service.domain.principal import Caller
from service.domain.task import Outcome, Task, TaskStatus, Wire, clamp_ttl, new_task_id
from service.domain.values import frozen
from service.observability import logging as logctx
from service.observability import metrics, tracing
from service.runtime.engine import Engine
from service.runtime.inline import CallEnd, InlineCallContext, RoundResult
from service.store import requests as rq
from service.store.batch import Batcher
from service.store.db import Database
from service.store.events import (
    EventHub,
)
from service.store.tasks import TaskStore
from service.store.usage import PlainCallTally
from service.tasks.cursor import CursorCodec
from service.tasks.plain import PlainSlots
from service.tasks.policy import TaskPolicy, capacity_error, refusal_scope
from service.tasks.request_state import RequestStateCodec
from service.tasks.streams import TaskStreams
from service.tools.api import ToolContext
from service.tools.registry import ToolSpec

PAGE_SIZE = 50
NOT_FOUND = "task not found (unknown, expired, or not yours)"


class CallMode(enum.Enum):
    """How a call may end (XD-5): inside its request only, as a task if it runs long, or as a task."""

    SYNC = "sync"
    OPTIONAL = "optional"
    REQUIRED = "required"


@frozen
class CallResult:
    """One of: the call's outcome; questions the client must answer (retry with them); the task it became."""

    outcome: Outcome | None = None
    questions: tuple[PendingInput, ...] = ()
    used: frozenset[str] = frozenset()  # with questions: the answers the run took (kept for the retry)
    task: Task | None = None


class TaskService:
    def __init__(
        self,
        db: Database,
        hub: EventHub,
        engine: Engine,
        policy: TaskPolicy,
        cursors: CursorCodec,
        request_states: RequestStateCodec,
        plain_calls: PlainCallTally | None = None,
    ) -> None:
        self.store = TaskStore(db)
        self.plain_calls = plain_calls or PlainCallTally()  # for usage: the maintenance pass writes them
        self.request_states = request_states
        self.hub = hub
        # The runtime: it runs every tool, and new tasks go straight to a free slot of this
        # process's runner when it has one.
        self.engine = engine
        self.registry = engine.registry
        self.policy = policy
        self.cursors = cursors
        # Group commit, one batcher per operation: creates and retrieves (which audit) each share
        # statements and commits; gets share read-only statements, so they never wait for a commit.
        # Only the gets hold a connection for a burst (Database.holding): a write batch costs the
        # database far more per statement (the commit, locks, the audit append) than the acquire,
        # and the acquire's time lets more of the next batch queue up (measured: holding shrank
        # create batches and cost 20 % of creates/s).
        self._creates = Batcher(self.store.create, name="create")
        self._retrieves = Batcher(self.store.retrieve, name="retrieve")
        self._gets = Batcher(self.store.get, name="get", hold=self.store.db.holding)
        self.plain = PlainSlots(self.store, policy.max_active_per_requestor, self._refuse_plain)
        self.streams = TaskStreams(hub, self.store, stale_delivery_ms=policy.stale_delivery_ms,
                                   lookup=lambda caller, task_id: self._gets.submit(rq.get(caller, task_id)),
                                   retrieve=self.retrieve)  # fmt: skip

    def check_call(
        self, name: str, arguments: dict[str, Any], *, as_task: bool, negotiate: bool = True
    ) -> tuple[ToolSpec, dict[str, Any]]:
        """Tool-level negotiation (T-TOOL-3/5) and schema validation (D-15), before any row exists."""
        spec = self.registry.get(name)
        if negotiate and as_task and spec.task_support == "forbidden":
            raise TaskSupportMismatch(f"tool {name!r} does not support task-augmented execution")
        if negotiate and not as_task and spec.task_support == "required":
            raise TaskSupportMismatch(f"Task augmentation required for tool {name!r}: send params.task")
        return spec, spec.validate(arguments)

    async def start_plain(
        self, caller: Caller, tool: str, arguments: dict[str, Any], ctx: ToolContext
    ) -> asyncio.Future[Outcome]:
        """A plain call (no task): one of the requestor's active-task slots held while it runs
        (from memory as a rule), its first step taken now. Beyond the cap: CapacityExceeded."""
        release = self.plain.take(caller) or await self.plain.hold(caller, tool)
        self.plain_calls.count(caller.principal.tenant_id, tool)
        job = self.engine.start_plain(tool, arguments, ctx)
        if job.done():
            release()
        else:
            job.add_done_callback(lambda _job: release())
        return job

    async def ask_first(
        self, work: Callable[[InlineCallContext], Awaitable[Any]], *, responses: dict[str, InputResponse],
        client_capabilities: dict[str, Any],
    ) -> RoundResult[Any]:  # fmt: skip
        """Run something that is not a tool call (a prompt) that may ask the client first: done, or
        the questions the retry must answer."""
        return await self.engine.ask_first(work, responses=responses, client_capabilities=client_capabilities)

    def _enqueue_create(self, request: rq.CreateRequest) -> asyncio.Future[Task | None]:
        """A create into the next batch of creates; once it is known to have committed (or may
        have), it is counted and the requestor's remembered count (for plain calls) forgotten."""
        created = self._creates.enqueue(request)
        key = (request.tenant_id, request.subject)

        def settled(future: asyncio.Future[Task | None]) -> None:
            self.plain.forget(key)
            if not future.cancelled() and future.exception() is None and (task := future.result()) is not None:
                metrics.task_created(task.tool, task.tenant_id)

        created.add_done_callback(settled)
        return created

    def _requestor_cap(self, caller: Caller) -> int:
        """The per-requestor cap a create checks, less the plain calls the requestor runs here."""
        return self.policy.max_active_per_requestor - self.plain.running.get(caller.principal.owner_key, 0)

    async def create(
        self,
        caller: Caller,
        *,
        tool: str,
        arguments: dict[str, Any],
        ttl_ms: int | None,
        progress_token: str | int | None,
        session_id: str | None,
        client_capabilities: dict[str, Any],
        wire: Wire = Wire.V2025,
    ) -> Task:
        """Check the caps and insert under the tenant's create lock, so no replica can overshoot."""
        spec, valid = self.check_call(tool, arguments, as_task=True)
        if ttl_ms is not None and ttl_ms < 0:
            raise InvalidArguments("the task's ttl must be a non-negative integer (milliseconds)")
        p = self.policy
        granted = clamp_ttl(ttl_ms, default_ms=p.default_ttl_ms, min_ms=p.min_ttl_ms, max_ms=p.max_ttl_ms)
        task_id = new_task_id()
        # A free local slot: create the task already leased to it (no claim, no wake-up round trip).
        slot = self.engine.reserve(caller.principal.tenant_id, task_id)
        request = rq.create(
            caller,
            task_id,
            tool=tool,
            arguments=valid,
            wire=wire.value,
            session_id=session_id,
            # A session's capabilities are stored once, with the session, not copied into each of
            # its tasks (issue 14 §4); the runner reads them there when the task starts.
            client_capabilities={} if session_id is not None else client_capabilities,
            progress_token=progress_token,
            ttl_ms=granted,
            poll_interval_ms=p.poll_interval_ms,
            max_per_requestor=self._requestor_cap(caller),
            max_per_tenant=p.max_active_per_tenant,
            lease=slot.lease if slot is not None else None,
            rerunnable=spec.rerunnable,
            tool_version=spec.version,
            origin=spec.origin,
            max_tenant_bytes=p.tenant_storage_quota_bytes,
            trace_parent=tracing.traceparent(),
        )
        created = self._enqueue_create(request)
        if slot is not None:
            # The session's capabilities go with the task to the runner (not read back from the session row).
            self.engine.adopt(slot, created, client_capabilities if session_id is not None else None)
        # Shielded: a create whose caller went away still commits with its batch, and a task leased
        # to our runner is then started (or its slot given back) all the same.
        task = await asyncio.shield(created)
        if task is None:
            raise await self._refuse_capacity(caller, tool, size=request.size_bytes)
        logctx.note_task(task.task_id)
        return task

    async def call(
        self,
        caller: Caller,
        *,
        tool: str,
        arguments: dict[str, Any],
        mode: CallMode,
        responses: dict[str, InputResponse],
        progress_token: str | int | None,
        client_capabilities: dict[str, Any],
        grace_s: float,
        on_event: Callable[[TaskEvent], None] | None = None,
    ) -> CallResult:
        """Run a call inside its request (2026-07-28): it ends there, asks for input (the client
        retries with the answers), or becomes a task (OPTIONAL after ``grace_s``; REQUIRED always).
        The task row is committed before this returns it (X-CREATE-3)."""
        spec, valid = self.check_call(tool, arguments, as_task=mode is not CallMode.SYNC, negotiate=False)
        engine = self.engine
        if mode is not CallMode.SYNC and not engine.runs_tasks:
            # No runner here to adopt a running call: the task is queued for one at once.
            return CallResult(task=await self._queue_for_call(caller, spec, valid, client_capabilities))
        # A call that stays in its request holds a slot like a plain 2025-11-25 call. One that may
        # become a task holds a runner slot of its tenant's share from the start (issue 42 §2): with
        # the tenant at its share it is a task at once that starts when a slot frees, as on
        # 2025-11-25.
        release = await self.plain.hold(caller, spec.name) if mode is CallMode.SYNC else None
        reserved = None if mode is CallMode.SYNC else engine.reserve_call(caller.principal.tenant_id, new_task_id())
        if mode is not CallMode.SYNC and reserved is None:
            return CallResult(task=await self._queue_for_call(caller, spec, valid, client_capabilities))
        try:
            call = engine.start_call(spec.name, valid, responses=responses, progress_token=progress_token,
                                     client_capabilities=client_capabilities, on_event=on_event,
                                     caller=caller.principal.owner_key,
                                     may_become_task=mode is not CallMode.SYNC)  # fmt: skip
            if release is not None:
                call.job.add_done_callback(lambda _job: release())
            round_ = await call.round(None if mode is CallMode.SYNC else grace_s)
        except BaseException:
            if reserved is not None:
                engine.release(reserved)
            raise
        if round_.end is CallEnd.NEEDS_INPUT or (round_.end is CallEnd.DONE and mode is not CallMode.REQUIRED):
            if reserved is not None:
                engine.release(reserved)
            if round_.end is CallEnd.NEEDS_INPUT:
                return CallResult(questions=round_.questions, used=round_.used)
            self.plain_calls.count(caller.principal.tenant_id, spec.name)
            return CallResult(outcome=round_.outcome)
        assert reserved is not None, "a call that stays in its request (SYNC) ends there"
        task_id = reserved.task_id
        slot = engine.hand_over(call, reserved)
        if slot is None:  # shutting down or its lease lapsing: nothing is created, the client retries
            call.cancel()
            raise Unavailable("this replica cannot run the task now (it is shutting down or lost its database); retry")
        request = self._extension_request(caller, task_id, spec, valid, client_capabilities, slot.lease)
        created = self._enqueue_create(request)
        engine.adopt_call(slot, call, created)
        # If the client goes away now, the create still completes (shielded) and the task lives on:
        # closing the request does not cancel a task that exists (X-HTTP-7).
        task = await asyncio.shield(created)
        if task is None:
            raise await self._refuse_capacity(caller, spec.name, size=request.size_bytes)
        logctx.note_task(task.task_id)
        return CallResult(task=task)

    def _extension_request(
        self, caller: Caller, task_id: str, spec: ToolSpec, arguments: dict[str, Any],
        client_capabilities: dict[str, Any], lease: rq.Lease | None,
    ) -> rq.CreateRequest:  # fmt: skip
        """The create of a 2026-07-28 call becoming a task: the server chooses the TTL (X-TTL-8)
        and there is no progress for tasks (X-NOTIF-8)."""
        p = self.policy
        return rq.create(
            caller, task_id, tool=spec.name, arguments=arguments, wire=Wire.V2026.value,
            session_id=None, client_capabilities=client_capabilities, progress_token=None,
            ttl_ms=p.default_ttl_ms, poll_interval_ms=p.poll_interval_ms,
            max_per_requestor=self._requestor_cap(caller), max_per_tenant=p.max_active_per_tenant, lease=lease,
            rerunnable=spec.rerunnable, tool_version=spec.version, origin=spec.origin,
            max_tenant_bytes=p.tenant_storage_quota_bytes, trace_parent=tracing.traceparent(),
        )  # fmt: skip

    async def _queue_for_call(
        self, caller: Caller, spec: ToolSpec, arguments: dict[str, Any], client_capabilities: dict[str, Any]
    ) -> Task:
        """No runner here to adopt a running call: the task is created unleased, for any runner."""
        request = self._extension_request(caller, new_task_id(), spec, arguments, client_capabilities, None)
        task = await asyncio.shield(self._enqueue_create(request))
        if task is None:
            raise await self._refuse_capacity(caller, spec.name, size=request.size_bytes)
        logctx.note_task(task.task_id)
        return task

    async def _refuse_plain(self, caller: Caller, tool: str, plain: int) -> CapacityExceeded:
        return await self._refuse_capacity(caller, tool, plain=plain)

    async def _refuse_capacity(
        self, caller: Caller, tool: str, *, plain: int | None = None, size: int = 0
    ) -> CapacityExceeded:
        """A cap refused a create (or a plain call), or the storage quota a create of ``size``
        bytes: record the denial with the counts as they stand now, the requestor's plain calls
        running here included."""
        if plain is None:
            plain = self.plain.running.get(caller.principal.owner_key, 0)
        decide = refusal_scope(self.policy, plain=plain, size=size)
        return capacity_error(*await self.store.refuse_create(caller, tool, decide))

    @staticmethod
    def _visible(task: Task | None, wire: Wire) -> Task | None:
        """XD-3: a 2025-11-25 session never sees a task created through the extension."""
        if task is not None and wire is Wire.V2025 and task.wire != Wire.V2025.value:
            return None
        return task

    async def get(self, caller: Caller, task_id: str, *, wire: Wire = Wire.V2025) -> Task:
        """The caller's task; a miss (unknown, expired or someone else's) is audited as a denial."""
        task = self._visible(await self._gets.submit(rq.get(caller, task_id)), wire)
        if task is None:
            raise await self._not_found(caller, task_id)
        tracing.link_task(task.trace_parent)  # this request links to the task's trace
        return task

    async def retrieve(self, caller: Caller, task_id: str, *, wire: Wire = Wire.V2025) -> Task:
        """Like get; a terminal task's hand-out is audited in the same statement (once per requestor
        per MCP_TASKS_AUDIT_RETRIEVE_INTERVAL_S)."""
        task = self._visible(await self._retrieves.submit(rq.retrieve(caller, task_id)), wire)
        if task is None:
            raise await self._not_found(caller, task_id)
        tracing.link_task(task.trace_parent)  # this request links to the task's trace
        return task

    async def _not_found(self, caller: Caller, task_id: str) -> TaskNotFound:
        await self.store.deny(caller, "not_found", task_id[:200])
        return TaskNotFound(NOT_FOUND, task_id=task_id)

    async def list_page(self, caller: Caller, cursor: str | None) -> tuple[list[Task], str | None]:
        """The caller's 2025-11-25 tasks, newest first (the extension has no list, X-SEC-4)."""
        principal = caller.principal
        after = self.cursors.decode(principal, cursor) if cursor is not None else None
        tasks = await self.store.list_tasks(principal, after=after, limit=PAGE_SIZE + 1)
        next_cursor = None
        if len(tasks) > PAGE_SIZE:
            tasks = tasks[:PAGE_SIZE]
            last = tasks[-1]
            next_cursor = self.cursors.encode(principal, last.created_at, last.task_id)
        return tasks, next_cursor

    async def cancel(self, caller: Caller, task_id: str, *, wire: Wire = Wire.V2025) -> Task:
        """T-CANCEL-5 / XD-7: the row is cancelled (and its lease dropped) before we answer.
        Raises TaskAlreadyTerminal for a task that had already ended (with it in ``details``)."""
        if wire is Wire.V2025:
            # A 2025-11-25 session may not touch a task created through the extension.
            await self.get(caller, task_id, wire=wire)
        result = await self.store.cancel(caller, task_id, "cancelled by the requestor")
        if result.task is not None:
            metrics.finished(result.task)
            tracing.link_task(result.task.trace_parent)
            return result.task
        if result.existing is None:
            raise TaskNotFound(NOT_FOUND, task_id=task_id)
        status = result.existing.status.value
        raise TaskAlreadyTerminal(
            f"Cannot cancel task: already in terminal status '{status}'", task_id=task_id, status=status
        )

    async def pending_inputs(self, caller: Caller, task: Task) -> list[PendingInput]:
        """Every question of the task still waiting for an answer (empty unless input_required)."""
        if task.status is not TaskStatus.INPUT_REQUIRED:
            return []
        return await self.store.pending_inputs(caller.principal, task.task_id)

    async def answer(self, caller: Caller, task_id: str | None, responses: dict[str, InputResponse]) -> bool:
        """Apply answers by key, all or nothing (InvalidArguments); unknown or already answered keys
        are ignored and the first answer per key wins. ``task_id`` None: the task is found by key.
        False when no key named an open question of the caller's."""
        return await self.store.answer(caller, task_id, responses) is not None
