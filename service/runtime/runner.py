"""Runner: claims tasks with SKIP LOCKED under a lease, runs their tools, records outcomes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from service.domain.errors import Unavailable
from service.domain.task import FailureReason, Outcome, Task
from service.observability import metrics
from service.runtime.context import TaskRunContext, TaskSink
from service.runtime.handback import hand_back
from service.store.batch import Batcher
from service.store.db import Database
from service.store.events import Event, EventHub, Resync, TaskCancelRequested, TaskCreated, TaskDeleted
from service.store.liveness import LivenessLock
from service.store.repository import RunnerStore
from service.store.requests import FinishRequest, Lease, ReleaseRequest
from service.tools.execute import run_tool
from service.tools.registry import Registry

log = logging.getLogger(__name__)

TaskKey = tuple[str, str]
CLAIM_BATCH = 16


class Runner:
    """Executes up to ``concurrency`` tasks at once in this process."""

    def __init__(
        self,
        db: Database,
        hub: EventHub,
        registry: Registry,
        *,
        concurrency: int,
        lease_ms: int,
        poll_s: float,
    ) -> None:
        self.store = RunnerStore(db)
        self.hub = hub
        self.registry = registry
        self.concurrency = concurrency
        self.lease_ms = lease_ms
        self.poll_s = poll_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.liveness = LivenessLock(db.dsn)
        self._running: dict[TaskKey, asyncio.Task[None]] = {}
        self._reserved = 0  # slots promised to creates and claims in flight (see reserve)
        self._jobs: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        # Whether tasks may be queued that we could not take for want of a slot: only then does a
        # freed slot trigger a claim (otherwise the claim loop's poll finds stragglers).
        self._backlog = True
        self._loops: list[asyncio.Task[None]] = []
        self._stopping = False
        self._draining = False
        self._database_ok = True
        self._tools = sorted(registry.tools)  # claims take only tasks of tools loaded here
        self._finishes = Batcher(self.store.finish, name="finishes")

    @property
    def busy(self) -> int:
        return len(self._running)

    def reserve(self, *, running: bool = False) -> Lease | None:
        """A free slot for a task this process is about to create: the lease to create it under,
        or None. The creator must call ``adopt`` (or ``adopt_running``) either way. ``running``: the
        call already runs here (it began inside its request), so it takes a slot even when none is
        free rather than stop."""
        if self._stopping or self._draining or not self.liveness.held:
            return None
        if not running and self.busy + self._reserved >= self.concurrency:
            return None
        self._reserved += 1
        return Lease(self.owner, self.liveness.key, self.lease_ms)

    def _sink(self, task: Task) -> TaskSink:
        return TaskSink(task, owner=self.owner, store=self.store, hub=self.hub, poll_s=self.poll_s)

    def adopt_running(self, task: Task, job: asyncio.Task[Outcome], attach: Callable[[str, TaskSink], None]) -> None:
        """A call that began inside its request became ``task`` (created under a reserved lease):
        from now on its events and questions go through the task, and its outcome is recorded
        like any other run's."""
        self._reserved -= 1
        if self._stopping:  # too late to run it here: stop it and give it back like any other
            job.cancel()
            self._background(self._hand_back([task], "re-queued: the runner was shut down"))
            return
        attach(task.task_id, self._sink(task))
        metrics.task_start_delay.labels(task.tool).observe(0.0)
        key = (task.tenant_id, task.task_id)
        self._running[key] = asyncio.create_task(self._execute(task, job), name=f"task-{task.task_id[:8]}")
        metrics.runner_slots_in_use.set(self.busy)

    def adopt(self, task: Task | None) -> None:
        """Run a task created under a reserved lease (None: a cap refused it, nothing was written)."""
        self._reserved -= 1
        if task is None:
            if self._backlog:  # the slot it held is free again
                self._wake.set()
            return
        if self._stopping:  # it never started: back to the queue, whatever its tool
            self._background(
                self._hand_back([task], "re-queued: the runner was shut down before it started", never_started=True)
            )
            return
        metrics.task_start_delay.labels(task.tool).observe(0.0)
        self._start(task)

    def adopt_unknown(self, tenant_id: str, task_id: str) -> None:
        """The create under a reserved lease failed without an answer (cancelled, connection lost):
        its row may exist, leased to us. Start it if so; the slot stays reserved until we know."""
        self._background(self._adopt_by_id(tenant_id, task_id))

    async def _adopt_by_id(self, tenant_id: str, task_id: str) -> None:
        try:
            task = await self.store.leased(tenant_id, task_id, self.owner)
        except Exception as exc:  # the lease lapses and the reaper takes the task over
            log.warning("could not look up task %s after a failed create: %s", task_id[:8], exc)
            task = None
        self.adopt(task)

    async def _cancel_if_not_ours(self, key: TaskKey) -> None:
        """Stop a running task whose row no longer gives it to us (cancelled, expired, taken)."""
        try:
            still = await self.store.leased(key[0], key[1], self.owner)
        except Exception as exc:  # the heartbeat's renewal decides next time
            log.warning("could not re-read task %s after a cancel event: %s", key[1][:8], exc)
            return
        job = self._running.get(key)
        if still is None and job is not None:
            job.cancel()

    def _background(self, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(job)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    def _start(self, task: Task) -> None:
        key = (task.tenant_id, task.task_id)
        self._running[key] = asyncio.create_task(self._execute(task), name=f"task-{task.task_id[:8]}")
        metrics.runner_slots_in_use.set(self.busy)

    async def start(self) -> None:
        metrics.runner_slots.set(self.concurrency)
        await self.liveness.acquire()
        self.hub.listeners.append(self._on_event)
        self._loops = [
            asyncio.create_task(self._claim_loop(), name="runner-claim"),
            asyncio.create_task(self._heartbeat_loop(), name="runner-heartbeat"),
        ]

    def drain(self) -> None:
        """A shutdown began: claim nothing more; leases of running tasks are still renewed."""
        if not self._draining:
            self._draining = True
            log.info("runner draining: %d task(s) running, no new claims", self.busy)

    async def stop(self, deadline: float | None = None) -> None:
        """Stop claiming; let running tasks finish until ``deadline`` (loop time), then hand what
        is left back (re-queue or fail) so none stays working."""
        self.drain()
        running = list(self._running.values())
        if running and deadline is not None:
            timeout = deadline - asyncio.get_running_loop().time()
            if timeout > 0:
                await asyncio.wait(running, timeout=timeout)
            left = sum(1 for job in running if not job.done())
            log.info("runner stopping: %d task(s) finished in the grace, %d handed back", len(running) - left, left)
        self._stopping = True
        with contextlib.suppress(ValueError):
            self.hub.listeners.remove(self._on_event)
        for loop in self._loops:
            loop.cancel()
        for loop in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        running = list(self._running.values())
        for job in running:
            job.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await asyncio.gather(*self._jobs, return_exceptions=True)
        await self.liveness.release()

    def _on_event(self, event: Event) -> None:
        if isinstance(event, TaskCreated | Resync):
            self._wake.set()
        elif isinstance(event, TaskCancelRequested | TaskDeleted):
            key = (event.tenant_id, event.task_id)
            if key in self._running:
                # An event is a hint anyone who may NOTIFY could send: the row decides.
                self._background(self._cancel_if_not_ours(key))

    def _database_lost(self, what: str, exc: Exception) -> None:
        """One log line when the database goes away, not one per poll (the recovery logs once too)."""
        if self._database_ok:
            self._database_ok = False
            log.warning("runner lost the database while it %s: %s; retrying every %.1f s", what, exc, self.poll_s)

    def _database_back(self) -> None:
        if not self._database_ok:
            self._database_ok = True
            log.warning("runner reached the database again")

    async def _claim_loop(self) -> None:
        while True:
            try:
                claimed = await self._claim()
                self._database_back()
            except Unavailable as exc:
                self._database_lost("claimed", exc)
                claimed = 0
            except Exception:  # keep claiming whatever one pass ran into
                log.exception("runner claim pass failed")
                claimed = 0
            if claimed < CLAIM_BATCH or self.busy >= self.concurrency:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.poll_s)

    async def _claim(self) -> int:
        # Cleared before the claim, so a wake-up that arrives during it is not lost.
        self._wake.clear()
        if self._draining:
            return 0
        free = self.concurrency - self.busy - self._reserved
        if free <= 0:
            self._backlog = True  # whatever woke us waits for a slot
            return 0
        await self.liveness.ensure()
        want = min(free, CLAIM_BATCH)
        self._reserved += want  # creates meanwhile must not promise these slots too
        try:
            tasks = await self.store.claim(self.owner, self.liveness.key, self.lease_ms, want, self._tools)
        finally:
            self._reserved -= want
        self._backlog = len(tasks) == want  # a full claim: there may be more
        now = datetime.now(UTC)
        for task in tasks:
            metrics.task_start_delay.labels(task.tool).observe(max(0.0, (now - task.created_at).total_seconds()))
            self._start(task)
        return len(tasks)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            # Snapshot first: a task claimed while the renewal is in flight is not judged by it.
            running = list(self._running)
            if not running:
                continue
            try:
                await self.liveness.ensure()
                held = await self.store.renew(self.owner, self.lease_ms, running)
            except Unavailable as exc:
                self._database_lost("renewed its leases", exc)
                continue
            except Exception:
                log.exception("runner lease renewal failed")
                continue
            for key in running:
                job = self._running.get(key)
                if job is not None and key not in held:  # cancelled, expired, or the lease was taken
                    job.cancel()

    async def _execute(self, task: Task, job: asyncio.Task[Outcome] | None = None) -> None:
        """Run the task's tool (or await ``job``, the call already running) and record its outcome."""
        key = (task.tenant_id, task.task_id)
        started = time.perf_counter()
        try:
            if job is None and task.session_id is not None and not task.client_capabilities:
                caps = await self.store.session_capabilities(task.tenant_id, task.session_id)
                task = dataclasses.replace(task, client_capabilities=caps)
            if job is None:
                outcome = await run_tool(
                    self.registry, task.tool, task.arguments, TaskRunContext(task, self._sink(task))
                )
            else:
                outcome = await job  # cancelling us cancels it
            metrics.task_run_seconds.labels(task.tool).observe(time.perf_counter() - started)
            await self._finish(task, outcome)
        except asyncio.CancelledError:
            if self._stopping:
                await self._hand_back([task], "re-queued: the runner was shut down")
        except Exception:
            ref = secrets.token_hex(6)
            log.exception("runner failed to record the outcome of task %s (reference %s)", task.task_id[:8], ref)
            await self._record_unstorable(task, ref)
        finally:
            self._running.pop(key, None)
            metrics.runner_slots_in_use.set(self.busy)
            if self._backlog:
                self._wake.set()

    async def _finish(self, task: Task, outcome: Outcome) -> None:
        """Record the outcome (group commit: with its audit event and wake-up, in one statement with
        the outcomes of other tasks finishing meanwhile). A finished tool's outcome is kept and its
        write retried while the database is away: a task never fails because its result could not
        be stored once (the lease check in the statement keeps a late write from a taken-over task)."""
        request = FinishRequest.of(task.tenant_id, task.task_id, task.subject, self.owner, outcome)
        delay = 0.25
        while True:
            finishing = self._finishes.enqueue(request)
            try:
                await asyncio.shield(finishing)
                return
            except asyncio.CancelledError:
                # Shutdown or a cancel event while the outcome is on its way: it lands or not, but
                # before anything else (a hand-back) touches the task, however often we are cancelled.
                while not finishing.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(finishing)
                raise
            except Unavailable as exc:
                if self._stopping:
                    raise
                self._database_lost("recorded an outcome", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _record_unstorable(self, task: Task, ref: str) -> None:
        """The outcome could not be stored: fail the task with a stored error rather than leave it working."""
        failure = Outcome.failure(
            FailureReason.UNSTORABLE, f"the tool finished but its result could not be stored (reference {ref})"
        )
        try:
            await self._finishes.submit(
                FinishRequest.of(task.tenant_id, task.task_id, task.subject, self.owner, failure)
            )
        except Exception as exc:  # the lease lapses (no longer renewed) and the reaper fails the task
            log.warning("could not record failure of task %s: %s", task.task_id[:8], exc)

    async def _hand_back(self, tasks: list[Task], why: str, *, never_started: bool = False) -> None:
        """Re-queue what may run again, fail the rest (the reaper's rule, handback.py)."""
        requests: list[ReleaseRequest] = [
            hand_back(self.registry, tenant_id=t.tenant_id, task_id=t.task_id, subject=t.subject, tool=t.tool,
                      owner=self.owner, why=why, never_started=never_started)
            for t in tasks
        ]  # fmt: skip
        try:
            await self.store.release(sorted(requests, key=lambda r: r.order))
        except Exception as exc:  # the reaper takes them over once our liveness lock is gone
            log.warning("could not hand back %d task(s): %s", len(requests), exc)
