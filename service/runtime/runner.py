"""Runner: claims tasks with SKIP LOCKED under a lease, runs their tools, records outcomes.

Every write of a run (outcome, hand-back, renewal, question) carries its fencing token and lands
only while that still holds the lease; a run whose lease could not be renewed in time has its
tool stopped before another runner may take the task (fencing.py). The runner's row in
``runners`` is the lease on all its tasks: the heartbeat extends it in one statement, and a task's
own (long) lease only once it is a lease old.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import secrets
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Coroutine
from datetime import UTC, datetime
from typing import Any

from service.domain.errors import Unavailable
from service.domain.stopping import cancel_and_wait
from service.domain.task import FailureReason, Outcome, Task, TaskStatus
from service.observability import metrics
from service.runtime.context import TaskRunContext, TaskSink
from service.runtime.fencing import ROW_LEASE, LeaseTimes, Run, overdue
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
        tenant_share: int | None = None,
    ) -> None:
        self.store = RunnerStore(db)
        self.hub = hub
        self.registry = registry
        self.concurrency = concurrency
        # The most of this process's slots one tenant may hold (MCP_TASKS_RUNNER_TENANT_SHARE).
        self.tenant_share = max(1, min(tenant_share or concurrency, concurrency))
        self.lease_ms = lease_ms
        self.poll_s = poll_s
        # ROW_LEASE marks an owner whose row is its lease on its tasks (lease_lapsed): a runner of an
        # earlier release is judged by its tasks' own leases only.
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}{ROW_LEASE}"
        self.times = LeaseTimes.of(lease_ms)
        self.liveness = LivenessLock(db.dsn, timeout_s=max(1.0, self.times.renew_every))
        self._running: dict[TaskKey, Run] = {}
        # A slot is a tool running: a run whose tool has ended (its outcome on its way to the
        # database) gives its slot back at once, so a slow outcome write holds up no next task. Per
        # tenant, kept as runs start and their tools end (no walk over the runs per create).
        self._slots_by_tenant: Counter[str] = Counter()
        self._slots_in_use = 0
        self._recording = 0  # runs whose tool ended, their outcome not yet written
        self._recording_by_tenant: Counter[str] = Counter()
        # When the last statement that extended our row while it held was sent (start, a beat): our
        # row holds for at least a lease after it. New runs count on it.
        self._row_sent = 0.0
        # Fenced runs whose leases we still hold, handed back once the database answers again: when
        # each was fenced, and whether its tool never started.
        self._fenced: dict[TaskKey, tuple[Task, float, bool]] = {}
        self._reserved = 0  # slots promised to creates and claims in flight (see reserve)
        self._reserved_by_tenant: Counter[str] = Counter()  # the creates' part of it, per tenant
        # While a claim is in flight: what each tenant held when it was sent, and how many it asked for.
        self._claiming: tuple[dict[str, int], int] | None = None
        # The tenants whose tasks were created while that claim was in flight: whether to claim
        # again for them is decided once its answer is counted (see _on_event).
        self._created_in_flight: set[str] = set()
        # When each reservation of a create was made (its lease's start is later), and when our row
        # was last extended at that moment (what covers the create): see _reserved_since.
        self._reserved_at: deque[tuple[float, float]] = deque()
        self._jobs: set[asyncio.Task[object]] = set()
        self._giving_back: asyncio.Task[object] | None = None  # the fenced runs' hand-back, one at a time
        self._wake = asyncio.Event()
        # Whether tasks may be queued that we could not take for want of a slot: only then does a
        # freed slot trigger a claim (otherwise the claim loop's poll finds stragglers).
        self._backlog = True
        # A claim was held back because our row looked stale: the next beat that lands wakes one.
        self._claim_after_beat = False
        self._loops: list[asyncio.Task[None]] = []
        self._stopping = False
        self._draining = False
        self._database_ok = True
        # Claims take only tasks of tools loaded here, at their version (name → version or None).
        self._tools = {name: registry.tools[name].version for name in sorted(registry.tools)}
        self._finishes = Batcher(self.store.finish, name="finishes")  # writes: see TaskService._writes

    @property
    def busy(self) -> int:
        """Slots in use: tools running, plus the outcome writes beyond ``concurrency`` waiting (so
        a database that records slower than tools end cannot pile up runs in memory unbounded)."""
        return self._slots_in_use + max(0, self._recording - self.concurrency)

    def held(self) -> Counter[str]:
        """Slots per tenant: tools running here, creates promised a slot, and outcome writes
        waiting beyond the tenant's share (so a tenant whose writes back up cannot, by starting
        ever more tools, fill the process's bound on runs in memory and starve the others)."""
        tenants = {*self._slots_by_tenant, *self._reserved_by_tenant, *self._recording_by_tenant}
        return Counter({tenant: n for tenant in tenants if (n := self._held_by(tenant))})

    def _held_by(self, tenant_id: str) -> int:
        return (
            self._slots_by_tenant[tenant_id]
            + self._reserved_by_tenant[tenant_id]
            + max(0, self._recording_by_tenant[tenant_id] - self.tenant_share)
        )

    def _recorded(self, run: Run, delta: int) -> None:
        """A run's outcome write began (+1) or ended (-1)."""
        tenant = run.task.tenant_id
        self._recording += delta
        self._recording_by_tenant[tenant] += delta
        if self._recording_by_tenant[tenant] <= 0:
            del self._recording_by_tenant[tenant]

    def _take_slot(self, run: Run) -> None:
        self._slots_in_use += 1
        self._slots_by_tenant[run.task.tenant_id] += 1
        metrics.runner_slots_in_use.set(self.busy)

    def _give_slot(self, run: Run) -> None:
        """The run's tool ended (or never will): its slot is free; once only."""
        if not run.holds_slot:
            return
        run.holds_slot = False
        tenant = run.task.tenant_id
        self._slots_in_use -= 1
        self._slots_by_tenant[tenant] -= 1
        if self._slots_by_tenant[tenant] <= 0:
            del self._slots_by_tenant[tenant]
        metrics.runner_slots_in_use.set(self.busy)
        if self._backlog:
            self._wake.set()

    def _at_share(self, tenant_id: str) -> bool:
        """Would one more slot take the tenant past its share, counting what a claim in flight may
        still give it?"""
        held = self._held_by(tenant_id)
        if self._claiming is not None:
            sent, want = self._claiming
            held += max(0, min(want, self.tenant_share - sent.get(tenant_id, 0)))
        return held >= self.tenant_share

    def _row_stale(self) -> bool:
        """Our row may be lapsing (no beat landed for half the fence time): a lease taken now might
        not be covered by the time its statement is answered, so none is taken."""
        return time.monotonic() - self._row_sent >= self.times.fence_after / 2

    def reserve(self, tenant_id: str, *, running: bool = False) -> Lease | None:
        """A free slot for a task of ``tenant_id`` this process is about to create: the lease to
        create it under, or None (no free slot, or the tenant holds its share of them). The creator
        must call ``adopt`` (or ``adopt_running``) either way. ``running``: the call already runs
        here (it began inside its request), so it takes a slot even when none is free rather than stop."""
        if self._stopping or self._draining or not self.liveness.held:
            return None
        if self._row_stale():
            return None
        if not running and (self.busy + self._reserved >= self.concurrency or self._at_share(tenant_id)):
            return None
        self._reserved += 1
        self._reserved_by_tenant[tenant_id] += 1
        self._reserved_at.append((time.monotonic(), self._row_sent))
        return Lease(self.owner, self.liveness.key, self.times.task_lease_ms)

    def _unreserve(self, tenant_id: str) -> tuple[float, float]:
        """Give a create's reserved slot back; times no later than the start of its own lease and
        than the extension of our row that covers it."""
        self._reserved -= 1
        self._reserved_by_tenant[tenant_id] -= 1
        if self._reserved_by_tenant[tenant_id] <= 0:
            del self._reserved_by_tenant[tenant_id]
        return self._reserved_since()

    def _reserved_since(self) -> tuple[float, float]:
        """Times no later than the start of the lease of the create being adopted and than the row
        extension covering it: those of the oldest outstanding reservation (its own is among them).
        Taken when the slot was reserved: a row revived since then does not cover it."""
        if self._reserved_at:
            return self._reserved_at.popleft()
        return time.monotonic(), self._row_sent

    def _sink(self, task: Task) -> TaskSink:
        return TaskSink(task, owner=self.owner, store=self.store, hub=self.hub, poll_s=self.poll_s)

    def adopt_running(self, task: Task, job: asyncio.Task[Outcome], attach: Callable[[str, TaskSink], None]) -> None:
        """A call that began inside its request became ``task`` (created under a reserved lease):
        from now on its events and questions go through the task, and its outcome is recorded
        like any other run's."""
        since, row_sent = self._unreserve(task.tenant_id)
        if self._stopping:  # too late to run it here: stop it and give it back like any other
            job.cancel()
            self._background(self._hand_back([task], "re-queued: the runner was shut down"))
            return
        attach(task.task_id, self._sink(task))
        metrics.labelled(metrics.task_start_delay, task.tool).observe(0.0)
        self._start(task, since, job, covered_since=min(since, row_sent))

    def adopt(self, task: Task | None, *, tenant_id: str, capabilities: dict[str, Any] | None = None) -> None:
        """Run a task of ``tenant_id`` created under a reserved lease (None: a cap refused it,
        nothing was written). ``capabilities``: what the client of the task's session declared,
        as the creating request knew it (the run then need not read them from the session row)."""
        since, row_sent = self._unreserve(tenant_id)
        if task is None:
            if self._backlog:  # the slot it held is free again
                self._wake.set()
            return
        if self._stopping:  # it never started: back to the queue, whatever its tool
            self._background(
                self._hand_back([task], "re-queued: the runner was shut down before it started", never_started=True)
            )
            return
        metrics.labelled(metrics.task_start_delay, task.tool).observe(0.0)
        self._start(task, since, capabilities=capabilities, covered_since=min(since, row_sent))

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
        if (tenant_id, task_id) in self._running:  # it runs here already (one run per task, never two)
            task = None
        self.adopt(task, tenant_id=tenant_id)

    async def _cancel_if_not_ours(self, key: TaskKey) -> None:
        """Stop a running tool whose row no longer gives it to us (cancelled, expired, taken)."""
        try:
            still = await self.store.leased(key[0], key[1], self.owner)
        except Exception as exc:  # the heartbeat's renewal decides next time
            log.warning("could not re-read task %s after a cancel event: %s", key[1][:8], exc)
            return
        run = self._running.get(key)
        if run is not None and (still is None or still.lease_epoch != run.task.lease_epoch):
            self._stop_tool(run)

    @staticmethod
    def _stop_tool(run: Run) -> None:
        """The lease is no longer ours: stop the tool. An outcome already in hand is still offered
        to the database, whose fencing check refuses it (a refused write is final)."""
        if not run.tool_done:
            run.job.cancel()

    def _background(self, job: Coroutine[Any, Any, object]) -> asyncio.Task[object]:
        task = asyncio.create_task(job)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        return task

    def _start(
        self, task: Task, leased_at: float, job: asyncio.Task[Outcome] | None = None, *,
        capabilities: dict[str, Any] | None = None, covered_since: float | None = None,
    ) -> Run | None:  # fmt: skip
        """``leased_at``: no later than the statement that set the task's own lease; ``covered_since``:
        no later than the one that extended our row for it (a claim does both). The run, or None:
        it was handed back unstarted, its lease being possibly lapsed."""
        key = (task.tenant_id, task.task_id)
        covered = leased_at if covered_since is None else covered_since
        if covered + self.times.fence_after <= time.monotonic():
            # Its lease may have lapsed already (our row did, say): it must not start here.
            if job is not None:
                job.cancel()
            metrics.runner_fenced.inc()
            self._background(self._hand_back([task], "re-queued: the runner's lease ran out before the task started",
                                              never_started=job is None))  # fmt: skip
            return None
        execute = self._execute(task, job, capabilities)
        run = Run(task, asyncio.create_task(execute, name=f"task-{task.task_id[:8]}"), covered, leased_at,
                  tool_started=job is not None)  # fmt: skip
        self._running[key] = run
        self._take_slot(run)
        run.job.add_done_callback(functools.partial(self._if_never_started, run, job))
        return run

    def _if_never_started(self, run: Run, call: asyncio.Task[Outcome] | None, _job: asyncio.Task[None]) -> None:
        """A run cancelled before its first step (a cancel, a fence or a shutdown in the loop turn
        that started it) never entered _execute, so no except or finally of it ran: do here what
        they do on a cancel. Its slot is the sign: _execute's finally always gives it back."""
        if not run.holds_slot:
            return
        if call is not None:
            call.cancel()  # cancelling the run cancels the call it would have awaited
        if (back := self._after_cancel(run, run.task)) is not None:
            self._background(back)
        self._ended(run)

    def _after_cancel(self, run: Run, task: Task) -> Coroutine[Any, Any, bool] | None:
        """What follows a run's cancel: at shutdown, the hand-back to await; a fenced run's task is
        kept to give back once the database answers. A run stopped before its tool was called (in
        its first step, or while it read its session's capabilities) goes back to the queue
        whatever its tool: nothing of it ran."""
        never_started = not run.tool_started
        if self._stopping:
            return self._hand_back([task], "re-queued: the runner was shut down", never_started=never_started)
        if run.fenced:
            self._fenced[(task.tenant_id, task.task_id)] = (task, time.monotonic(), never_started)
        return None

    def _ended(self, run: Run) -> None:
        """A run is over (its outcome written, refused, or handed back): it leaves the runner."""
        key = (run.task.tenant_id, run.task.task_id)
        if self._running.get(key) is run:
            del self._running[key]
        if run.tool_done:
            self._recorded(run, -1)
        self._give_slot(run)
        metrics.runner_slots_in_use.set(self.busy)
        if self._backlog:
            self._wake.set()

    async def start(self) -> None:
        metrics.runner_slots.set(self.concurrency)
        await self.liveness.acquire()
        sent = time.monotonic()
        await self._publish()
        self._row_sent = sent
        self.hub.listeners.append(self._on_event)
        self._loops = [
            asyncio.create_task(self._claim_loop(), name="runner-claim"),
            asyncio.create_task(self._heartbeat_loop(), name="runner-heartbeat"),
            asyncio.create_task(self._fence_loop(), name="runner-fence"),
        ]

    def drain(self) -> None:
        """A shutdown began: claim nothing more; leases of running tasks are still renewed."""
        if not self._draining:
            self._draining = True
            log.info(
                "runner draining: %d task(s) running or recording their outcome, no new claims", len(self._running)
            )

    async def stop(self, deadline: float | None = None) -> None:
        """Stop claiming; let running tasks finish until ``deadline`` (loop time), then hand what
        is left back (re-queue or fail) so none stays working."""
        self.drain()
        running = [run.job for run in self._running.values()]
        if running and deadline is not None:
            timeout = deadline - asyncio.get_running_loop().time()
            if timeout > 0:
                await asyncio.wait(running, timeout=timeout)
            left = sum(1 for job in running if not job.done())
            log.info("runner stopping: %d task(s) finished in the grace, %d handed back", len(running) - left, left)
        self._stopping = True
        with contextlib.suppress(ValueError):
            self.hub.listeners.remove(self._on_event)
        await cancel_and_wait(*self._loops)
        running = [run.job for run in self._running.values()]
        for job in running:
            job.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await asyncio.gather(*self._jobs, return_exceptions=True)
        if self._fenced:  # give them back now rather than leave them to the reaper
            await self._hand_back_fenced()
        try:
            await self.store.withdraw(self.owner)
        except Exception as exc:  # its row lapses by itself (live_until)
            log.warning("runner could not withdraw its tools: %s", exc)
        await self.liveness.release()

    async def _publish(self) -> None:
        """Say what this runner can run, for a lease's time (the maintenance pass tells tasks whose
        tool no live runner has so, see runners.sql): at start, and afresh after our row lapsed.
        The heartbeat keeps it live in between."""
        tools = {name: {"version": spec.version, "rerunnable": spec.rerunnable}
                 for name, spec in self.registry.tools.items()}  # fmt: skip
        await self.store.publish(self.owner, self.liveness.key, tools, self.lease_ms)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, TaskCreated):
            if self._claiming is not None:
                # The claim in flight may have read the queue before this task's create committed,
                # and what it brings the tenant is not known yet: decided once its answer is counted
                # (a backlog marked now was set afresh from that answer; the task waited for the poll).
                self._created_in_flight.add(event.tenant_id)
            else:
                self._created(event.tenant_id)
        elif isinstance(event, Resync):
            # Cancels or deletes may have been missed: the next beat reads every run's row.
            for run in self._running.values():
                run.task_lease_set_at = -math.inf
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
        with contextlib.suppress(Unavailable):  # best effort: the lock decides nothing (liveness.py)
            await self.liveness.ensure()
        if self._row_stale():  # checked after the last await before the claim is sent
            # What it claimed could not start (_start hands back runs our row may no longer cover),
            # and each hand-back costs the task an attempt: claim again once a beat lands.
            self._claim_after_beat = True
            return 0
        want = min(free, CLAIM_BATCH)
        held = dict(self.held())
        self._reserved += want  # creates meanwhile must not promise these slots too
        self._claiming = (held, want)  # nor take a tenant past its share with what this claim brings
        sent, row_sent = time.monotonic(), self._row_sent
        answered = False
        try:
            # Bounded: a claim answered late would start runs whose leases are already old.
            tasks = await asyncio.wait_for(
                self.store.claim(
                    self.owner, self.liveness.key, self.times.claim_lease_ms, want, self._tools,
                    tenant_share=self.tenant_share, held=held,
                    running=Counter((run.task.tenant_id, run.task.subject) for run in self._running.values()
                                    if run.holds_slot),
                ),
                timeout=self.times.claim_timeout,
            )  # fmt: skip
            answered = True
        except TimeoutError as exc:
            raise Unavailable(f"the claim got no answer within {self.times.claim_timeout:.1f} s") from exc
        finally:
            self._reserved -= want
            self._claiming = None
            late, self._created_in_flight = self._created_in_flight, set()
            if not answered:  # nothing to count: decided as if the claim had brought nothing
                for tenant_id in late:
                    self._created(tenant_id)
        self._database_back()  # only an answered claim says so (a held-back one asked nothing)
        # A full claim, or a tenant at its share whose queued tasks the claim skipped: there may be
        # more, so a freed slot claims again.
        for task in tasks:
            held[task.tenant_id] = held.get(task.tenant_id, 0) + 1
        self._backlog = len(tasks) == want or any(n >= self.tenant_share for n in held.values())
        now = datetime.now(UTC)
        started = 0
        for task in tasks:
            metrics.labelled(metrics.task_start_delay, task.tool).observe(
                max(0.0, (now - task.created_at).total_seconds())
            )
            # The claim reads our row, never extends it.
            run = self._start(task, sent, covered_since=min(sent, row_sent))
            if run is not None:
                started += 1
                # Its own lease is the short claim lease: the first beat half a lease after the
                # claim extends it (fencing.py, CLAIM_RENEW_AFTER), as if it had been set earlier.
                run.task_lease_set_at = sent + self.times.claim_renew_after - self.times.task_renew_after
        for tenant_id in late:
            self._created(tenant_id)
        return started

    def _created(self, tenant_id: str) -> None:
        """A task of ``tenant_id`` was queued (no claim in flight, or its answer counted)."""
        if self._at_share(tenant_id):
            # Its task cannot be claimed here now: a claim would skip the tenant's rows, after
            # walking past every one of them (one busy tenant's creates each woke a claim that
            # scanned its whole queue). One of its slots freed here claims again (the backlog).
            self._backlog = True
        else:
            self._wake.set()

    async def _heartbeat_loop(self) -> None:
        ok = True
        while True:
            await asyncio.sleep(self.times.renew_every if ok else self.times.retry_every)
            ok = await self._renew()
            if ok and self._fenced and (self._giving_back is None or self._giving_back.done()):
                # Off the beat: a fenced run's row may be locked elsewhere (its release waits for the
                # lock), and the next beat must not wait for that.
                self._giving_back = self._background(self._hand_back_fenced())

    async def _renew(self) -> bool:
        """The heartbeat: extend our row, the lease of every run at once, and the tasks' own leases
        of the runs whose lease is due; stop the tools of those the database no longer gives us.
        False when the database did not answer in time."""
        # Snapshot first: a task claimed while the beat is in flight is not judged by it.
        runs = [(key, run) for key, run in self._running.items() if not run.fenced]
        sent = time.monotonic()
        due = [(key, run.task.lease_epoch) for key, run in runs
               if sent - run.task_lease_set_at >= self.times.task_renew_after]  # fmt: skip
        try:
            # Bounded: an answer that does not come must not hold up the next attempt.
            extended, held, busy = await asyncio.wait_for(
                self.store.renew(self.owner, self.lease_ms, due, self.times.task_lease_ms),
                timeout=self.times.renew_every,
            )
        except TimeoutError:
            self._database_lost("renewed its leases", Unavailable(f"no answer within {self.times.renew_every:.1f} s"))
            return False
        except Unavailable as exc:
            self._database_lost("renewed its leases", exc)
            return False
        except Exception:
            log.exception("runner lease renewal failed")
            return False
        self._database_back()
        if not extended:
            await self._row_lapsed()
            return True
        self._row_sent = max(self._row_sent, sent)
        if self._claim_after_beat:
            self._claim_after_beat = False
            self._wake.set()
        due_keys = {key for key, _epoch in due}
        for key, run in runs:
            if self._running.get(key) is not run:
                continue
            if key not in due_keys:  # its own lease has three leases left: the row was all it needed
                run.renewed_at = max(run.renewed_at, sent)
            elif key in held:
                run.renewed_at = max(run.renewed_at, sent)
                run.task_lease_set_at = sent
            elif key in busy:
                # Its row was locked elsewhere: not renewed, so not covered by this beat either. It
                # stays due; a lock held past the fence stops this run alone, not every run.
                continue
            else:  # cancelled, expired, or the lease was taken
                self._stop_tool(run)
        return True

    async def _row_lapsed(self) -> None:
        """The database answered, but our row had lapsed (no beat landed for a lease): the reaper may
        take any task we run, so every run still going stops now (as a fence would), and the row is
        published afresh, for new work only. Not before: a revived row must not cover old runs."""
        stopped = [run for run in self._running.values() if not run.tool_done and not run.fenced]
        for run in stopped:
            run.fenced = True
            run.job.cancel()
        if stopped:
            metrics.runner_fenced.inc(len(stopped))
        log.warning(
            "runner's row had lapsed (no heartbeat reached the database for a lease): %d running tool(s) "
            "stopped, their tasks go back (re-run or failed); publishing the runner afresh",
            len(stopped),
        )
        sent = time.monotonic()
        try:
            await self._publish()
        except Exception as exc:  # the next beat finds it still lapsed and tries again
            log.warning("runner could not publish itself afresh: %s", exc)
            return
        self._row_sent = sent
        self._claim_after_beat = False
        self._wake.set()  # new work may be claimed under the fresh row

    async def _fence_loop(self) -> None:
        """Stop the tools of runs whose lease could not be renewed in time, before the reaper could
        take their tasks: this process may not count on those leases any more. It needs the
        database for nothing, so a database that does not answer cannot delay it."""
        while True:
            fenced, wake = overdue(self._running.values(), time.monotonic(), self.times)
            for run in fenced:
                run.fenced = True
                run.job.cancel()
            if fenced:
                metrics.runner_fenced.inc(len(fenced))
                log.warning(
                    "runner could not renew the leases of %d task(s) for %.1f s: their tools are stopped and "
                    "their outcomes will not be written; the tasks go back (re-run or failed) once the database "
                    "answers or their leases run out",
                    len(fenced),
                    self.times.fence_after,
                )
            await asyncio.sleep(wake)

    async def _hand_back_fenced(self) -> None:
        """The database answers again: give back the fenced runs' tasks at once (under their epochs;
        those the reaper took meanwhile are refused and dropped). Older than a task's own (full) lease
        and a fence: the reaper's; one fenced before its first renewal may be refused sooner."""
        now = time.monotonic()
        for key, (_task, at, _never_started) in list(self._fenced.items()):
            if now - at > self.times.task_lease_ms / 1000 + self.times.fence_after:  # lapsed by its own lease
                del self._fenced[key]
        tasks = [task for task, _at, _never_started in self._fenced.values()]
        if not tasks:
            return
        unstarted = {key for key, (_task, _at, never_started) in self._fenced.items() if never_started}
        try:
            answered = await asyncio.wait_for(
                self._hand_back(tasks, "re-queued: the runner lost the database", never_started=unstarted),
                timeout=self.times.renew_every,
            )
        except TimeoutError:
            return
        if not answered:
            return
        for task in tasks:
            self._fenced.pop((task.tenant_id, task.task_id), None)

    async def _execute(
        self, task: Task, job: asyncio.Task[Outcome] | None = None, capabilities: dict[str, Any] | None = None
    ) -> None:
        """Run the task's tool (or await ``job``, the call already running) and record its outcome.
        A session's task reads what its client declared from the session (not stored per task),
        unless the creating request handed it over (``capabilities``)."""
        run = self._running[(task.tenant_id, task.task_id)]  # _start put it there before this first ran
        started = time.perf_counter()
        try:
            caps = task.client_capabilities
            if job is None and task.session_id is not None and not caps:
                if capabilities is None:
                    capabilities = await self._session_capabilities(task.tenant_id, task.session_id)
                caps = capabilities
            run.tool_started = True
            if job is None:
                outcome = await run_tool(
                    self.registry, task.tool, task.arguments, TaskRunContext(task, self._sink(task), caps)
                )
            else:
                outcome = await job  # cancelling us cancels it
            if run.fenced:  # a tool that ignored its cancel: what it returned is not ours to write
                raise asyncio.CancelledError
            run.tool_done = True  # from here on the run is recording its outcome
            self._recorded(run, +1)
            self._give_slot(run)
            metrics.labelled(metrics.task_run_seconds, task.tool).observe(time.perf_counter() - started)
            await self._finish(task, outcome)
        except asyncio.CancelledError:
            if (back := self._after_cancel(run, task)) is not None:
                await back
        except Exception:
            ref = secrets.token_hex(6)
            log.exception("runner failed to record the outcome of task %s (reference %s)", task.task_id[:8], ref)
            await self._record_unstorable(task, ref)
        finally:
            self._ended(run)

    async def _session_capabilities(self, tenant_id: str, session_id: str) -> dict[str, Any]:
        """What the client of a task's session declared, read again while the database is away: a
        blip must not fail a task before its tool starts. For at most the fence time: the heartbeat
        fences the run (cancelling this wait) if the database stays away; an error that outlasts
        it while the beats land is no blip, and fails the task as before."""
        delay = 0.25
        give_up = time.monotonic() + self.times.fence_after
        while True:
            try:
                return await self.store.session_capabilities(tenant_id, session_id)
            except Unavailable:
                if time.monotonic() + delay > give_up:  # not a blip: fail the task as before
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _finish(self, task: Task, outcome: Outcome) -> None:
        """Record the outcome (group commit: with its audit event and wake-up, in one statement with
        the outcomes of other tasks finishing meanwhile). A finished tool's outcome is kept and its
        write retried while the database is away: a task never fails because its result could not
        be stored once. The write lands only under this run's fencing token (owner and epoch): once
        another runner took the task over it is refused, and a refusal is final."""
        request = FinishRequest.of(
            task.tenant_id, task.task_id, task.subject, self.owner, outcome, epoch=task.lease_epoch
        )
        delay = 0.25
        while True:
            finishing = self._finishes.enqueue(request)
            try:
                landed = await asyncio.shield(finishing)
            except asyncio.CancelledError:
                # Shutdown while the outcome is on its way: it lands or not, but before anything else
                # (a hand-back) touches the task, however often we are cancelled.
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
                continue
            if landed is None:
                await self._refused("finish", task)
            return

    async def _refused(self, op: str, task: Task) -> None:
        """A write of this run changed nothing. Counted and logged only when another runner took the
        task over (cancelled, expired, or our own earlier write whose answer was lost are not)."""
        try:
            state = await self.store.lease_state(task.tenant_id, task.task_id)
        except Exception:  # the write was refused all the same; only its reason is unknown
            return
        if state is None or state.status is TaskStatus.CANCELLED:
            return
        if state.epoch == task.lease_epoch and state.owner is None and state.status.is_terminal:
            return  # our write landed before: its answer was lost, and the retry found it done
        metrics.fenced_writes.labels(op).inc()
        log.warning(
            "runner's %s of task %s was refused: the task was taken over (lease epoch %d, now %d): "
            "nothing of this run was written",
            op,
            task.task_id[:8],
            task.lease_epoch,
            state.epoch,
        )

    async def _record_unstorable(self, task: Task, ref: str) -> None:
        """The outcome could not be stored: fail the task with a stored error rather than leave it working."""
        failure = Outcome.failure(
            FailureReason.UNSTORABLE, f"the tool finished but its result could not be stored (reference {ref})"
        )
        try:
            await self._finishes.submit(
                FinishRequest.of(
                    task.tenant_id, task.task_id, task.subject, self.owner, failure, epoch=task.lease_epoch
                )
            )
        except Exception as exc:  # the lease lapses (no longer renewed) and the reaper fails the task
            log.warning("could not record failure of task %s: %s", task.task_id[:8], exc)

    async def _hand_back(
        self, tasks: list[Task], why: str, *, never_started: bool | Collection[TaskKey] = False
    ) -> bool:
        """Re-queue what may run again, fail the rest (the reaper's rule, handback.py), under each
        run's fencing token. ``never_started``: all of them, or the keys of those whose tool was
        never called (they go back to the queue whatever their tool). False when the database did
        not answer."""
        requests: list[ReleaseRequest] = [
            hand_back(self.registry, tenant_id=t.tenant_id, task_id=t.task_id, subject=t.subject, tool=t.tool,
                      owner=self.owner, epoch=t.lease_epoch, why=why, rerunnable=t.rerunnable,
                      never_started=never_started if isinstance(never_started, bool)
                      else (t.tenant_id, t.task_id) in never_started)
            for t in tasks
        ]  # fmt: skip
        by_key = {(t.tenant_id, t.task_id): t for t in tasks}
        ordered = sorted(requests, key=lambda r: r.order)
        try:
            moved = await self.store.release(ordered)
        except Exception as exc:  # the reaper takes them over once their leases run out
            log.warning("could not hand back %d task(s): %s", len(requests), exc)
            return False
        for request, task in zip(ordered, moved, strict=True):
            if task is None:
                await self._refused("release", by_key[(request.tenant_id, request.task_id)])
        return True
