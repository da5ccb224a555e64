"""TaskService: the rules of the task lifecycle, one transaction per use case."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from service.domain.errors import (
    CapacityExceeded,
    DomainError,
    InvalidArguments,
    TaskAlreadyTerminal,
    TaskNotFound,
    TaskSupportMismatch,
)
from service.domain.principal import Caller, Principal
from service.domain.task import RELATED_TASK, Task, TaskStatus, clamp_ttl, new_task_id
from service.store import repository as repo
from service.store.batch import Batcher
from service.store.db import Database
from service.store.events import EventHub, notify
from service.tasks.audit import audit
from service.tasks.cursor import CursorCodec
from service.tools.registry import Registry, ToolSpec

PAGE_SIZE = 50
# A delivery to a stream that went away without releasing it (replica crash) is offered again after this.
STALE_DELIVERY_MS = 60_000
NOT_FOUND = "task not found (unknown, expired, or not yours)"


@dataclass(frozen=True, slots=True)
class TaskPolicy:
    default_ttl_ms: int
    min_ttl_ms: int
    max_ttl_ms: int
    poll_interval_ms: int
    max_active_per_requestor: int = 16
    max_active_per_tenant: int = 256


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A request a task sends its client (e.g. elicitation/create), to deliver on the stream."""

    rpc_id: str
    method: str
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Notice:
    """A notification for the client (progress, log) that is not stored."""

    method: str
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StatusChanged:
    task: Task


@dataclass(frozen=True, slots=True)
class Finished:
    task: Task


FollowEvent = ClientRequest | Notice | StatusChanged | Finished


class LocalRunner(Protocol):
    def reserve(self) -> tuple[str, int, int] | None: ...

    def adopt(self, task: Task | None) -> None: ...

    def adopt_unknown(self, tenant_id: str, task_id: str) -> None: ...


class TaskService:
    def __init__(
        self, db: Database, hub: EventHub, registry: Registry, policy: TaskPolicy, cursors: CursorCodec
    ) -> None:
        self.db = db
        self.hub = hub
        self.registry = registry
        self.policy = policy
        self.cursors = cursors
        # Tasks with a tasks/result stream open in this process: their notices go there only.
        self.following: Counter[tuple[str, str]] = Counter()
        # This process's runner, if it runs tasks: new tasks go straight to a free slot of it.
        self.runner: LocalRunner | None = None
        # Group commit (migration 0005): creates and retrieves (which audit) share statements and
        # commits; gets share read-only statements of their own, so they never wait for a commit.
        self._writes = Batcher(self._run_batch, self._run_item, order=repo.batch_order, name="writes")
        self._reads = Batcher(self._run_batch, self._run_item, order=repo.batch_order, name="reads")

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
        surface: str = "2025-11-25",
    ) -> Task:
        """Check the caps and insert under the tenant's create lock, so no replica can overshoot."""
        _spec, valid = self.check_call(tool, arguments, as_task=True)
        if ttl_ms is not None and ttl_ms < 0:
            raise InvalidArguments("task.ttl must be a non-negative integer (milliseconds)")
        p = self.policy
        granted = clamp_ttl(ttl_ms, default_ms=p.default_ttl_ms, min_ms=p.min_ttl_ms, max_ms=p.max_ttl_ms)
        # A free local slot: create the task already leased to it (no claim, no wake-up round trip).
        lease = self.runner.reserve() if self.runner is not None else None
        principal = caller.principal
        item = repo.create_item(
            principal=principal,
            task_id=new_task_id(),
            session_id=session_id,
            surface=surface,
            tool=tool,
            arguments=valid,
            client_capabilities=client_capabilities,
            progress_token=progress_token,
            ttl_ms=granted,
            poll_interval_ms=p.poll_interval_ms,
            max_per_requestor=p.max_active_per_requestor,
            max_per_tenant=p.max_active_per_tenant,
            request_id=caller.request_id,
            address=caller.address,
            detail={"tool": tool, "ttl_ms": granted},
            lease=lease,
        )
        created = self._writes.enqueue(item)
        try:
            # Shielded: a create whose caller went away still commits with its batch, and a task
            # leased to our runner must then be started (or its slot given back) all the same.
            task = await asyncio.shield(created)
        finally:
            if lease is not None:
                self._settle_lease(principal.tenant_id, item["task_id"], created)
        if task is None:
            raise await self._refuse_capacity(caller, tool)
        return task

    def _settle_lease(self, tenant_id: str, task_id: str, created: asyncio.Future[Task | None]) -> None:
        """Hand a create made under a reserved runner slot to the runner once its outcome is known."""
        runner = self.runner
        assert runner is not None
        if not created.done():
            created.add_done_callback(lambda _f: self._settle_lease(tenant_id, task_id, created))
        elif created.cancelled() or created.exception() is not None:
            # The statement may have committed before its answer was lost: the runner looks.
            runner.adopt_unknown(tenant_id, task_id)
        else:
            runner.adopt(created.result())

    async def _refuse_capacity(self, caller: Caller, tool: str) -> CapacityExceeded:
        """A cap refused a create: record the denial with the counts as they stand now."""
        p = self.policy
        async with self.db.transaction(caller.principal.tenant_id) as conn:
            mine, tenant = await repo.lock_and_count_active(conn, caller.principal)
            scope, limit, current = (
                ("tenant", p.max_active_per_tenant, tenant)
                if tenant >= p.max_active_per_tenant and mine < p.max_active_per_requestor
                else ("requestor", p.max_active_per_requestor, mine)
            )
            await audit(conn, caller, "deny", "cap_exceeded", scope=scope, limit=limit, current=current, tool=tool)
        return CapacityExceeded(
            f"too many active tasks for this {scope}: {current} of at most {limit}; "
            "wait for one to finish (or cancel one) and try again",
            scope=scope,
            limit=limit,
            current=current,
        )

    async def _load(self, principal: Principal, task_id: str) -> Task | None:
        return await self._reads.submit(repo.lookup_item(principal, task_id, retrieve=False))

    async def get(self, caller: Caller, task_id: str) -> Task:
        """The caller's task; a miss (unknown, expired or someone else's) is audited as a denial."""
        task = await self._load(caller.principal, task_id)
        if task is None:
            await self._deny_not_found(caller, task_id)
            raise TaskNotFound(NOT_FOUND, task_id=task_id)
        return task

    async def retrieve(self, caller: Caller, task_id: str) -> Task:
        """Like get; a terminal task's hand-out is audited in the same statement (T-SEC-10)."""
        item = repo.lookup_item(
            caller.principal, task_id, retrieve=True, request_id=caller.request_id, address=caller.address
        )
        task = await self._writes.submit(item)
        if task is None:
            await self._deny_not_found(caller, task_id)
            raise TaskNotFound(NOT_FOUND, task_id=task_id)
        return task

    async def _run_batch(self, items: list[repo.BatchItem]) -> list[Task | None]:
        async with self.db.connection() as conn:  # one statement, its own transaction (migration 0005)
            return await repo.run_batch(conn, items)

    async def _run_item(self, item: repo.BatchItem) -> Task | None:
        async with self.db.connection() as conn:
            return await repo.run_item(conn, item)

    async def _deny_not_found(self, caller: Caller, task_id: str) -> None:
        async with self.db.transaction(caller.principal.tenant_id) as conn:
            await audit(conn, caller, "deny", "not_found", task_id[:200])

    async def list(self, caller: Caller, cursor: str | None) -> tuple[list[Task], str | None]:
        principal = caller.principal
        after = self.cursors.decode(principal, cursor) if cursor is not None else None
        async with self.db.transaction(principal.tenant_id) as conn:
            tasks = await repo.list_tasks(conn, principal, after=after, limit=PAGE_SIZE + 1)
        next_cursor = None
        if len(tasks) > PAGE_SIZE:
            tasks = tasks[:PAGE_SIZE]
            last = tasks[-1]
            next_cursor = self.cursors.encode(principal, last.created_at, last.task_id)
        return tasks, next_cursor

    async def cancel(self, caller: Caller, task_id: str) -> Task:
        """T-CANCEL-5: the row is cancelled (and its lease dropped) before we answer."""
        principal = caller.principal
        refusal: DomainError | None = None
        async with self.db.transaction(principal.tenant_id) as conn:
            task = await repo.cancel_task(conn, principal, task_id, "cancelled by the requestor")
            if task is None:
                existing = await repo.get_task(conn, principal, task_id)
                if existing is None:
                    await audit(conn, caller, "deny", "not_found", task_id[:200])
                    refusal = TaskNotFound(NOT_FOUND, task_id=task_id)
                else:
                    await audit(conn, caller, "cancel", f"refused:{existing.status.value}", task_id)
                    refusal = TaskAlreadyTerminal(
                        f"Cannot cancel task: already in terminal status '{existing.status.value}'",
                        task_id=task_id,
                        status=existing.status.value,
                    )
            else:
                await audit(conn, caller, "cancel", "cancelled", task_id)
                await notify(conn, {"k": "cancel", "t": principal.tenant_id, "id": task_id})
                await notify(conn, {"k": "status", "t": principal.tenant_id, "id": task_id, "s": task.session_id})
        if refusal is not None:
            raise refusal
        assert task is not None
        return task

    async def follow(self, caller: Caller, task_id: str, *, poll_s: float) -> AsyncIterator[FollowEvent]:
        """Everything a blocking tasks/result stream carries, ending with the terminal task.

        Requests to the client are claimed for this stream alone (no broadcast, H-MULTI-2) and
        released if the stream goes away unanswered, so the next tasks/result gets them.
        """
        principal = caller.principal
        stream_id = secrets.token_urlsafe(12)
        key = (principal.tenant_id, task_id)
        carried = False  # whether this stream has claimed any of the task's requests
        self.following[key] += 1
        try:
            async with self.hub.subscribe(("task", principal.tenant_id, task_id)) as events:
                last_status = None
                loop = asyncio.get_running_loop()
                touched = loop.time()
                while True:
                    task = await self.retrieve(caller, task_id)  # read after subscribing: no change is missed
                    if task.status.is_terminal:
                        # C-10: requests this stream carried and nobody answered are void now.
                        if carried:
                            async with self.db.transaction(principal.tenant_id) as conn:
                                void = await repo.unanswered_for_stream(conn, principal.tenant_id, task_id, stream_id)
                            for rpc_id in void:
                                meta = {RELATED_TASK: {"taskId": task_id}}
                                params = {"requestId": rpc_id, "reason": f"task {task.status.value}", "_meta": meta}
                                yield Notice("notifications/cancelled", params)
                        yield Finished(task)
                        return
                    if last_status is not None and task.status != last_status:
                        yield StatusChanged(task)
                    last_status = task.status
                    # A task asks its client only while input_required (the request and the status
                    # change commit together), so only then is there anything to claim.
                    if task.status is TaskStatus.INPUT_REQUIRED:
                        async with self.db.transaction(principal.tenant_id) as conn:
                            pending = await repo.claim_undelivered_messages(
                                conn, principal.tenant_id, task_id, stream_id, STALE_DELIVERY_MS
                            )
                        carried = carried or bool(pending)
                        for msg in pending:
                            yield ClientRequest(msg["rpc_id"], msg["method"], msg["params"])
                    if carried and loop.time() - touched > STALE_DELIVERY_MS / 3000:
                        touched = loop.time()
                        async with self.db.transaction(principal.tenant_id) as conn:
                            await repo.touch_deliveries(conn, principal.tenant_id, stream_id)
                    # Wait for something to happen; notices are passed on without a re-read.
                    while True:
                        try:
                            event = await asyncio.wait_for(events.get(), timeout=poll_s)
                        except TimeoutError:
                            break
                        if event.get("k") in ("progress", "log") and isinstance(event.get("params"), dict):
                            method = "notifications/progress" if event["k"] == "progress" else "notifications/message"
                            yield Notice(method, event["params"])
                            continue
                        break
        finally:
            self.following[key] -= 1
            if self.following[key] <= 0:
                del self.following[key]
            if carried:
                with contextlib.suppress(Exception):
                    async with self.db.transaction(principal.tenant_id) as conn:
                        await repo.release_messages(conn, principal.tenant_id, stream_id)

    @contextlib.asynccontextmanager
    async def session_events(self, principal: Principal, session_id: str) -> AsyncIterator[AsyncIterator[FollowEvent]]:
        """For a session's GET stream: status changes and notices of tasks that session created,
        unless a tasks/result stream in this process already carries them (no duplicates).
        Subscribed on entry, so nothing is missed between subscribing and iterating."""
        async with self.hub.subscribe(("session", principal.tenant_id, session_id)) as queue:

            async def events() -> AsyncIterator[FollowEvent]:
                while True:
                    event = await queue.get()
                    task_id = str(event.get("id", ""))
                    if (principal.tenant_id, task_id) in self.following:
                        continue
                    kind = event.get("k")
                    if kind in ("progress", "log") and isinstance(event.get("params"), dict):
                        method = "notifications/progress" if kind == "progress" else "notifications/message"
                        yield Notice(method, event["params"])
                    elif kind == "status":
                        task = await self._load(principal, task_id)
                        if task is not None:
                            yield StatusChanged(task)

            yield events()

    async def answer(self, caller: Caller, rpc_id: str, answer: dict[str, Any]) -> bool:
        """A client's JSON-RPC response to a task's request; False if it answers nothing of ours."""
        principal = caller.principal
        async with self.db.transaction(principal.tenant_id) as conn:
            row = await repo.answer_message(conn, principal, rpc_id, answer)
            if row is None:
                return False
            result = answer.get("result")
            action = result.get("action") if isinstance(result, dict) else None
            # Only known words reach the audit trail: the client chooses this value.
            outcome = (
                action if action in ("accept", "decline", "cancel") else "invalid" if result is not None else "error"
            )
            await audit(conn, caller, "input", str(outcome), row["task_id"])
            await notify(conn, {"k": "answer", "t": principal.tenant_id, "id": row["task_id"]})
        return True
