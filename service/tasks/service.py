"""TaskService: the rules of the task lifecycle, for every wire alike.

It speaks domain records only: tasks, typed events (``service.domain.events``) and pending inputs
``(key, kind, params)`` answered by key. The edge (``service.mcp``) renders them for each wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
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
    Finished,
    InputRequested,
    InputVoided,
    LogEntry,
    Progress,
    StatusChanged,
    TaskEvent,
)
from service.domain.inputs import InputResponse, PendingInput
from service.domain.principal import Caller, Principal
from service.domain.task import Outcome, Task, TaskStatus, Wire, clamp_ttl, new_task_id
from service.domain.values import frozen
from service.observability import metrics
from service.runtime.engine import Engine
from service.runtime.inline import CallEnd, InlineCallContext, RoundResult
from service.store import requests as rq
from service.store.batch import Batcher
from service.store.db import Database
from service.store.events import (
    Event,
    EventHub,
    Resync,
    Subscription,
    TaskChanged,
    TaskDeleted,
    TaskLog,
    TaskProgress,
)
from service.store.tasks import TaskStore
from service.tasks.cursor import CursorCodec
from service.tasks.request_state import RequestStateCodec
from service.tools.api import ToolContext
from service.tools.registry import ToolSpec

PAGE_SIZE = 50
# A plain call reads its requestor's active-task count from the database at most this often
# (docs/decisions.md, "Plain calls and the cap"): a refusal is always decided on a fresh count.
PLAIN_CAP_RECOUNT_S = 1.0
# Remembered counts kept at most (oldest dropped first): one entry per requestor seen recently.
PLAIN_CAP_REMEMBERED = 10_000
NOT_FOUND = "task not found (unknown, expired, or not yours)"


@frozen
class TaskPolicy:
    default_ttl_ms: int
    min_ttl_ms: int
    max_ttl_ms: int
    poll_interval_ms: int
    max_active_per_requestor: int = 16
    max_active_per_tenant: int = 256
    # A question handed to a stream that went away without releasing it (replica crash) is
    # offered to the next stream after this.
    stale_delivery_ms: int = 60_000


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


def notice_of(event: Event) -> TaskEvent | None:
    """The domain event of a progress or log event, if it is one."""
    if isinstance(event, TaskProgress):
        return Progress(event.task_id, event.token, event.progress, event.total, event.message)
    if isinstance(event, TaskLog):
        return LogEntry(event.task_id, event.level, event.data, event.logger)
    return None


class _PlainSlot:
    """How a plain call gives its requestor's slot back: once, however often it is called."""

    __slots__ = ("_key", "_service")

    def __init__(self, service: TaskService, key: tuple[str, str]) -> None:
        self._service: TaskService | None = service
        self._key = key

    def __call__(self) -> None:
        service, self._service = self._service, None
        if service is not None:
            service._release_plain(self._key)


class TaskService:
    def __init__(
        self,
        db: Database,
        hub: EventHub,
        engine: Engine,
        policy: TaskPolicy,
        cursors: CursorCodec,
        request_states: RequestStateCodec,
    ) -> None:
        self.store = TaskStore(db)
        self.request_states = request_states
        self.hub = hub
        # The runtime: it runs every tool, and new tasks go straight to a free slot of this
        # process's runner when it has one.
        self.engine = engine
        self.registry = engine.registry
        self.policy = policy
        self.cursors = cursors
        # Tasks with a result stream open in this process: their notices go there only.
        self.following: Counter[tuple[str, str]] = Counter()
        # Group commit, one batcher per operation: creates and retrieves (which audit) each share
        # statements and commits; gets share read-only statements, so they never wait for a commit.
        # Only the gets hold a connection for a burst (Database.holding): a write batch costs the
        # database far more per statement (the commit, locks, the audit append) than the acquire,
        # and the acquire's time lets more of the next batch queue up (measured: holding shrank
        # create batches and cost 20 % of creates/s).
        self._creates = Batcher(self.store.create, name="create")
        self._retrieves = Batcher(self.store.retrieve, name="retrieve")
        self._gets = Batcher(self.store.get, name="get", hold=self.store.db.holding)
        # Plain (non-task) calls running in this process, per requestor: each holds one of its
        # requestor's active-task slots while it runs (issue 14 §7).
        self.plain_calls: Counter[tuple[str, str]] = Counter()
        # Per requestor: its active tasks as last read for a plain call, and when (monotonic).
        # Dropped when this process creates one of its tasks, so only other replicas' creates
        # of the last PLAIN_CAP_RECOUNT_S can go unseen by an admission.
        self._task_counts: dict[tuple[str, str], tuple[int, float]] = {}

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

    def take_plain_slot(self, caller: Caller) -> Callable[[], None] | None:
        """``hold_plain_slot`` without I/O: the slot, taken, when the requestor's remembered count
        admits it; None when only a fresh count can tell (then ``hold_plain_slot``)."""
        key = caller.principal.owner_key
        held = self.plain_calls.get(key, 0) + 1
        tasks = self._remembered_tasks(key)
        if tasks is None or tasks + held > self.policy.max_active_per_requestor:
            return None
        self.plain_calls[key] = held
        return _PlainSlot(self, key)

    async def hold_plain_slot(self, caller: Caller, tool: str) -> Callable[[], None]:
        """Take one of the requestor's active-task slots for a plain call (its tasks and the
        plain calls it runs here count together); returns how to give it back. Beyond the cap,
        the same refusal as a create: CapacityExceeded, audited."""
        if (slot := self.take_plain_slot(caller)) is not None:
            return slot
        key = caller.principal.owner_key
        self.plain_calls[key] += 1  # taken before the count is read: concurrent calls cannot overshoot
        limit = self.policy.max_active_per_requestor
        try:
            over = self.plain_calls[key] > limit
            if not over:
                tasks = self._remembered_tasks(key)
                if tasks is None or tasks + self.plain_calls[key] > limit:  # refused only on a fresh count
                    tasks = await self._count_tasks(caller.principal)
                over = tasks + self.plain_calls[key] > limit
            if over:
                raise await self._refuse_capacity(caller, tool, plain=self.plain_calls[key] - 1)
        except BaseException:
            self._release_plain(key)
            raise
        return _PlainSlot(self, key)

    async def start_plain(
        self, caller: Caller, tool: str, arguments: dict[str, Any], ctx: ToolContext
    ) -> asyncio.Future[Outcome]:
        """A plain call (no task): one of the requestor's active-task slots held while it runs
        (from memory as a rule), its first step taken now. Beyond the cap: CapacityExceeded."""
        release = self.take_plain_slot(caller) or await self.hold_plain_slot(caller, tool)
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

    def _remembered_tasks(self, key: tuple[str, str]) -> int | None:
        """The requestor's active tasks as read for a plain call within PLAIN_CAP_RECOUNT_S, if any."""
        remembered = self._task_counts.get(key)
        if remembered is None or time.monotonic() - remembered[1] > PLAIN_CAP_RECOUNT_S:
            return None
        return remembered[0]

    async def _count_tasks(self, principal: Principal) -> int:
        """The requestor's active tasks from the counters, remembered for the next plain calls."""
        count = await self.store.active_for(principal)
        counts = self._task_counts
        counts.pop(principal.owner_key, None)  # re-inserted last: the dict stays in order of reading
        counts[principal.owner_key] = (count, time.monotonic())
        if len(counts) > PLAIN_CAP_REMEMBERED:
            del counts[next(iter(counts))]
        return count

    def _enqueue_create(self, request: rq.CreateRequest) -> asyncio.Future[Task | None]:
        """A create into the next batch of creates; once it is known to have committed (or may
        have), it is counted and the requestor's remembered count (for plain calls) forgotten."""
        created = self._creates.enqueue(request)
        key = (request.tenant_id, request.subject)

        def settled(future: asyncio.Future[Task | None]) -> None:
            self._task_counts.pop(key, None)
            if not future.cancelled() and future.exception() is None and (task := future.result()) is not None:
                metrics.task_created(task.tool, task.tenant_id)

        created.add_done_callback(settled)
        return created

    def _release_plain(self, key: tuple[str, str]) -> None:
        self.plain_calls[key] -= 1
        if self.plain_calls[key] <= 0:
            del self.plain_calls[key]

    def _requestor_cap(self, caller: Caller) -> int:
        """The per-requestor cap a create checks, less the plain calls the requestor runs here."""
        return self.policy.max_active_per_requestor - self.plain_calls.get(caller.principal.owner_key, 0)

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
        )
        created = self._enqueue_create(request)
        if slot is not None:
            # The session's capabilities go with the task to the runner (not read back from the session row).
            self.engine.adopt(slot, created, client_capabilities if session_id is not None else None)
        # Shielded: a create whose caller went away still commits with its batch, and a task leased
        # to our runner is then started (or its slot given back) all the same.
        task = await asyncio.shield(created)
        if task is None:
            raise await self._refuse_capacity(caller, tool)
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
        # A call that stays in its request holds a slot like a plain 2025-11-25 call; one that may
        # become a task is counted as the task it becomes.
        release = await self.hold_plain_slot(caller, spec.name) if mode is CallMode.SYNC else None
        call = engine.start_call(spec.name, valid, responses=responses, progress_token=progress_token,
                                 client_capabilities=client_capabilities, on_event=on_event)  # fmt: skip
        if release is not None:
            call.job.add_done_callback(lambda _job: release())
        round_ = await call.round(None if mode is CallMode.SYNC else grace_s)
        if round_.end is CallEnd.NEEDS_INPUT:
            return CallResult(questions=round_.questions, used=round_.used)
        if round_.end is CallEnd.DONE and mode is not CallMode.REQUIRED:
            return CallResult(outcome=round_.outcome)
        task_id = new_task_id()
        slot = engine.hand_over(call, caller.principal.tenant_id, task_id)
        if slot is None:  # shutting down or its lease lapsing: nothing is created, the client retries
            call.cancel()
            raise Unavailable("this replica cannot run the task now (it is shutting down or lost its database); retry")
        created = self._enqueue_create(self._extension_request(caller, task_id, spec, valid, client_capabilities,
                                                               slot.lease))  # fmt: skip
        engine.adopt_call(slot, call, created)
        # If the client goes away now, the create still completes (shielded) and the task lives on:
        # closing the request does not cancel a task that exists (X-HTTP-7).
        task = await asyncio.shield(created)
        if task is None:
            raise await self._refuse_capacity(caller, spec.name)
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
            rerunnable=spec.rerunnable, tool_version=spec.version,
        )  # fmt: skip

    async def _queue_for_call(
        self, caller: Caller, spec: ToolSpec, arguments: dict[str, Any], client_capabilities: dict[str, Any]
    ) -> Task:
        """No runner here to adopt a running call: the task is created unleased, for any runner."""
        request = self._extension_request(caller, new_task_id(), spec, arguments, client_capabilities, None)
        task = await asyncio.shield(self._enqueue_create(request))
        if task is None:
            raise await self._refuse_capacity(caller, spec.name)
        return task

    async def _refuse_capacity(self, caller: Caller, tool: str, *, plain: int | None = None) -> CapacityExceeded:
        """A cap refused a create (or a plain call): record the denial with the counts as they
        stand now, the requestor's plain calls running here included."""
        p = self.policy
        if plain is None:
            plain = self.plain_calls.get(caller.principal.owner_key, 0)

        def decide(mine: int, tenant: int) -> tuple[str, int, int]:
            mine += plain
            if tenant >= p.max_active_per_tenant and mine < p.max_active_per_requestor:
                return "tenant", p.max_active_per_tenant, tenant
            return "requestor", p.max_active_per_requestor, mine

        scope, limit, current = await self.store.refuse_create(caller, tool, decide)
        return CapacityExceeded(
            f"too many active tasks for this {scope}: {current} of at most {limit}; "
            "wait for one to finish (or cancel one) and try again",
            scope=scope,
            limit=limit,
            current=current,
        )

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
        return task

    async def retrieve(self, caller: Caller, task_id: str) -> Task:
        """Like get (2025-11-25 only); a terminal task's hand-out is audited in the same statement."""
        task = self._visible(await self._retrieves.submit(rq.retrieve(caller, task_id)), Wire.V2025)
        if task is None:
            raise await self._not_found(caller, task_id)
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

    def watch_task(self, caller: Caller, task_id: str) -> Subscription:
        """The caller's task's events from now on: open it before a read that ``follow`` goes on
        from (``opened``), so no change after that read is missed."""
        return self.hub.open(("task", caller.principal.tenant_id, task_id))

    async def follow(
        self, caller: Caller, task_id: str, *, poll_s: float, opened: tuple[Subscription, Task] | None = None
    ) -> AsyncIterator[TaskEvent]:
        """Everything a blocking result stream (2025-11-25) carries, ending with Finished.

        Questions are claimed for this stream alone (no broadcast, H-MULTI-2) and released if the
        stream goes away unanswered, so the next result stream gets them. ``opened``: a
        subscription of ``watch_task`` and the task as read after it was opened (the stream starts
        from that read instead of reading again, and closes the subscription).
        """
        tenant = caller.principal.tenant_id
        stream_id = secrets.token_urlsafe(12)
        key = (tenant, task_id)
        carried = False  # whether this stream has claimed any of the task's questions
        subscription, known = opened if opened is not None else (self.watch_task(caller, task_id), None)
        self.following[key] += 1
        try:
            events = subscription.queue
            last_status = None
            loop = asyncio.get_running_loop()
            touched = loop.time()
            stale_ms = self.policy.stale_delivery_ms
            while True:
                # Read after subscribing: no change is missed.
                if known is None:
                    task = await self.retrieve(caller, task_id)
                else:
                    task, known = known, None
                if task.status.is_terminal:
                    # C-10: questions this stream carried that nobody answered are void now.
                    if carried:
                        for input_key in await self.store.unanswered_for_stream(tenant, task_id, stream_id):
                            yield InputVoided(task_id, input_key, f"task {task.status.value}")
                    yield Finished(task)
                    return
                if last_status is not None and task.status != last_status:
                    yield StatusChanged(task)
                last_status = task.status
                # A task asks its client only while input_required (the question and the status
                # change commit together), so only then is there anything to claim.
                if task.status is TaskStatus.INPUT_REQUIRED:
                    pending = await self.store.claim_inputs(tenant, task_id, stream_id, stale_ms)
                    carried = carried or bool(pending)
                    for question in pending:
                        yield InputRequested(task_id, question)
                if carried and loop.time() - touched > stale_ms / 3000:
                    touched = loop.time()
                    await self.store.touch_deliveries(tenant, stream_id)
                # Wait for something to happen; notices are passed on without a re-read.
                while True:
                    try:
                        event = await asyncio.wait_for(events.get(), timeout=poll_s)
                    except TimeoutError:
                        break
                    if (notice := notice_of(event)) is not None:
                        yield notice
                        continue
                    break
        finally:
            subscription.close()
            self.following[key] -= 1
            if self.following[key] <= 0:
                del self.following[key]
            if carried:
                with contextlib.suppress(Exception):
                    await self.store.release_deliveries(tenant, stream_id)

    async def watch(self, caller: Caller, tasks: list[Task], *, poll_s: float) -> AsyncIterator[Task]:
        """Each change of the caller's ``tasks`` (as read now), until every one has ended. Changes
        made on any replica arrive through the store's events; a poll every ``poll_s`` covers an
        event lost on the way (XD-14)."""
        tenant = caller.principal.tenant_id
        seen: dict[str, tuple[Any, ...]] = {
            t.task_id: (t.status, t.last_updated_at) for t in tasks if not t.status.is_terminal
        }
        async with self.hub.subscribe(*(("task", tenant, task_id) for task_id in seen)) as events:
            while seen:
                changed: set[str] = set()
                try:
                    event = await asyncio.wait_for(events.get(), timeout=poll_s)
                    if isinstance(event, TaskChanged | TaskDeleted) and event.task_id in seen:
                        changed.add(event.task_id)
                    elif isinstance(event, Resync):
                        changed = set(seen)
                except TimeoutError:
                    changed = set(seen)
                for task_id in sorted(changed):
                    task = await self._gets.submit(rq.get(caller, task_id))
                    if task is None:  # expired and deleted: nothing more to say
                        del seen[task_id]
                        continue
                    state = (task.status, task.last_updated_at)
                    if state != seen[task_id]:
                        seen[task_id] = state
                        yield task
                    if task.status.is_terminal:
                        del seen[task_id]

    @contextlib.asynccontextmanager
    async def session_events(self, principal: Principal, session_id: str) -> AsyncIterator[AsyncIterator[TaskEvent]]:
        """For a session's GET stream: status changes and notices of tasks that session created,
        unless a result stream in this process already carries them (no duplicates).
        Subscribed on entry, so nothing is missed between subscribing and iterating."""
        caller = Caller(principal)
        async with self.hub.subscribe(("session", principal.tenant_id, session_id)) as queue:

            async def events() -> AsyncIterator[TaskEvent]:
                while True:
                    event = await queue.get()
                    task_id = getattr(event, "task_id", None)
                    if task_id is None or (principal.tenant_id, task_id) in self.following:
                        continue
                    if (notice := notice_of(event)) is not None:
                        yield notice
                    elif isinstance(event, TaskChanged):
                        task = await self._gets.submit(rq.get(caller, task_id))
                        if task is not None:
                            yield StatusChanged(task)

            yield events()
