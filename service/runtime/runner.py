"""Runner: carries out what its ledger decides: claims, runs, beats, fences, hand-backs.

Every decision (which task may start, when to claim, which runs a beat covers, which tools stop)
is the ledger's (``ledger.py``); this loop feeds it what happened, with the time it was read, and
does the I/O its commands ask for. Three loops: claims (woken by the ledger, else every poll
interval), the heartbeat (one statement extends the runner's row, the lease on all its runs, and
the tasks' own leases that are due) and the fence (stops tools no beat covered in time; it needs
no database, so a database that does not answer cannot delay it). What a run writes is
``records.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from service.concurrency.stopping import cancel_and_wait
from service.domain.errors import Unavailable
from service.domain.task import Task
from service.observability import metrics
from service.runtime.commands import (
    CheckLease,
    Command,
    HandBack,
    LookUp,
    Publish,
    Reservation,
    Run,
    Start,
    Stop,
)
from service.runtime.executor import Executor
from service.runtime.fencing import LeaseTimes
from service.runtime.inline import InlineCall
from service.runtime.ledger import Ledger
from service.runtime.publishing import ToolPublishing
from service.runtime.records import Outage, RunRecords
from service.runtime.runs import RunLimits, Runs
from service.store.db import Database
from service.store.events import Event, EventHub, Resync, TaskCancelRequested, TaskCreated, TaskDeleted
from service.store.requests import Lease
from service.store.runners import RunnerStore

log = logging.getLogger(__name__)


class Runner(ToolPublishing):
    """Executes up to ``concurrency`` tasks at once in this process."""

    def __init__(
        self, db: Database, hub: EventHub, executor: Executor, *, concurrency: int, lease_ms: int, poll_s: float,
        tenant_share: int | None = None, limits: RunLimits | None = None,
    ) -> None:  # fmt: skip
        self.store = RunnerStore(db)
        self.hub = hub
        self.executor = executor
        self.registry = executor.registry
        self.lease_ms = lease_ms
        self.poll_s = poll_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.times = LeaseTimes.of(lease_ms)
        # The most of this process's slots one tenant may hold (MCP_TASKS_RUNNER_TENANT_SHARE).
        self.ledger = Ledger(concurrency=concurrency, tenant_share=tenant_share or concurrency, times=self.times)
        self.outage = Outage(poll_s)
        self.records = RunRecords(self.store, self.owner, self.outage)
        self.runs = Runs(self.ledger, executor, self.records, self.store, hub, owner=self.owner, poll_s=poll_s,
                         times=self.times, settled=self._settled, limits=limits or RunLimits())  # fmt: skip
        self._background: set[asyncio.Task[Any]] = set()
        self._giving_back: asyncio.Task[Any] | None = None  # the fenced runs' hand-back, one at a time
        self._wake = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        # Claims take only tasks of tools loaded here, at their version (name → version or None).
        self._tools = {name: self.registry.tools[name].version for name in sorted(self.registry.tools)}

    @property
    def concurrency(self) -> int:
        return self.ledger.concurrency

    @property
    def busy(self) -> int:
        return self.ledger.busy

    def _carry_out(
        self, commands: Iterable[Command], *, call: InlineCall | None = None,
        capabilities: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Do what the ledger asked. ``call`` and ``capabilities``: what the adopting create brought
        (the running call to await; what the client of the task's session declared)."""
        for command in commands:
            if isinstance(command, Start):
                self.runs.launch(command.run, call, capabilities)
            elif isinstance(command, Stop):
                self.runs.cancel(command.run)
            elif isinstance(command, HandBack):
                if command.fenced:
                    metrics.runner_fenced.inc(command.fenced)
                self._spawn(self.records.hand_back(command))
            elif isinstance(command, LookUp):
                self._spawn(self._look_up(command))
            elif isinstance(command, CheckLease):
                self._spawn(self._check_lease(command.run))
            elif isinstance(command, Publish):
                self._spawn(self._publish_afresh())
        self._settled()

    def _settled(self) -> None:
        """After each event: answered runs given a slot go on, the gauge, a claim if one is due."""
        self.runs.wake_resumed()
        metrics.runner_slots_in_use.set(self.ledger.busy)
        metrics.runner_waiting.set(self.ledger.slots.waiting.total)
        if self.ledger.claim_due:
            self._wake.set()

    def _spawn(self, job: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.create_task(job)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ---- creates straight to a slot of this process ------------------------------------------

    def reserve(self, tenant_id: str, *, running: bool = False, inline: bool = False) -> Reservation | None:
        """A free slot for a task of ``tenant_id`` this process is about to create (see
        ``Ledger.reserve``); settle it with ``adopt``, ``adopt_call`` or ``answer_lost``."""
        return self.ledger.reserve(tenant_id, time.monotonic(), running=running, inline=inline)

    def convert(self, reservation: Reservation) -> bool:
        """The call that held ``reservation`` becomes its task now (see ``Ledger.converting``)."""
        return self.ledger.converting(reservation, time.monotonic())

    def lease(self) -> Lease:
        """The lease a create under a reservation of ours is written with."""
        return Lease(self.owner, self.times.task_lease_ms)

    def adopt(self, reservation: Reservation, task: Task | None, capabilities: dict[str, Any] | None = None) -> None:
        """Run ``task``, created under ``reservation`` (None: a cap refused it, nothing was written).
        ``capabilities``: what the client of the task's session declared, as the creating request
        knew it (the run then need not read them from the session row)."""
        if task is not None:
            metrics.labelled(metrics.task_start_delay, task.tool).observe(0.0)
        self._carry_out(self.ledger.adopted(reservation, task, time.monotonic()), capabilities=capabilities)

    def adopt_call(self, reservation: Reservation, task: Task, call: InlineCall) -> None:
        """A call that began inside its request became ``task``: from now on its events and
        questions go through the task, and its outcome is recorded like any other run's."""
        metrics.labelled(metrics.task_start_delay, task.tool).observe(0.0)
        commands = self.ledger.adopted(reservation, task, time.monotonic())
        if not any(isinstance(command, Start) for command in commands):
            call.cancel()  # it goes back to the queue, or fails, by the hand-back rule
        else:
            call.attach(task.task_id, self.runs.sink(task))
        self._carry_out(commands, call=call)

    def answer_lost(self, reservation: Reservation, task_id: str) -> None:
        """The create under ``reservation`` failed without an answer: its row may exist, leased to us."""
        self._carry_out(self.ledger.answer_lost(reservation, task_id))

    async def _look_up(self, command: LookUp) -> None:
        tenant_id = command.reservation.tenant_id
        try:
            task = await self.store.leased(tenant_id, command.task_id, self.owner)
        except Exception as exc:  # the lease lapses and the reaper takes the task over
            log.warning("could not look up task %s after a failed create: %s", command.task_id[:8], exc)
            task = None
        self.adopt(command.reservation, task)

    # ---- events of the store -------------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        if isinstance(event, TaskCreated):
            self.ledger.created(event.tenant_id)
            self._settled()
        elif isinstance(event, Resync):
            self.ledger.resync()
            self._settled()
        elif isinstance(event, TaskCancelRequested | TaskDeleted):
            self._carry_out(self.ledger.cancel_seen((event.tenant_id, event.task_id)))

    async def _check_lease(self, run: Run) -> None:
        """Stop a running tool whose row no longer gives it to us (cancelled, expired, taken)."""
        try:
            still = await self.store.leased(run.task.tenant_id, run.task.task_id, self.owner)
        except Exception as exc:  # the heartbeat's renewal decides next time
            log.warning("could not re-read task %s after a cancel event: %s", run.task.task_id[:8], exc)
            return
        commands = self.ledger.lease_checked(run, still.lease_epoch if still is not None else None)
        if still is not None and not commands and self.ledger.runs.get(run.key) is run:
            metrics.runner_unconfirmed_stops.inc()
        self._carry_out(commands)

    # ---- the loops ---------------------------------------------------------------------------

    async def start(self) -> None:
        metrics.runner_slots.set(self.concurrency)
        self._tool_metrics()
        sent = time.monotonic()
        await self._publish()
        self.ledger.published(sent)
        self.hub.listeners.append(self._on_event)
        self.registry.listeners.append(self._tools_changed)
        self._loops = [
            asyncio.create_task(self._claim_loop(), name="runner-claim"),
            asyncio.create_task(self._heartbeat_loop(), name="runner-heartbeat"),
            asyncio.create_task(self._fence_loop(), name="runner-fence"),
        ]

    async def _publish_afresh(self) -> None:
        """Our row had lapsed and every run it covered was stopped: publish it afresh, for new work."""
        sent = time.monotonic()
        try:
            await self._publish()
        except Exception as exc:  # the next beat finds it still lapsed and tries again
            log.warning("runner could not publish itself afresh: %s", exc)
            return
        self.ledger.published(sent)
        self._settled()

    async def _claim_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._claim()
            except Exception:  # keep claiming whatever one pass ran into
                log.exception("runner claim pass failed")
            if not self.ledger.claim_due:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.poll_s)

    async def _claim(self) -> None:
        claim = self.ledger.begin_claim(time.monotonic())
        if claim is None:
            return
        try:
            # Bounded: a claim answered late would start runs whose leases are already old.
            tasks = await asyncio.wait_for(
                self.store.claim(self.owner, self.times.claim_lease_ms, claim.want, self._tools,
                                 tenant_share=self.ledger.tenant_share, held=claim.held, running=claim.running),
                timeout=self.times.claim_timeout,
            )  # fmt: skip
        except BaseException as exc:
            self.ledger.claim_failed()
            self._settled()
            if isinstance(exc, TimeoutError):
                self.outage.lost("claimed", Unavailable(f"no answer within {self.times.claim_timeout:.1f} s"))
            elif isinstance(exc, Unavailable):
                self.outage.lost("claimed", exc)
            else:
                raise
            return
        self.outage.back()
        now = datetime.now(UTC)
        for task in tasks:
            delay = max(0.0, (now - task.created_at).total_seconds())
            metrics.labelled(metrics.task_start_delay, task.tool).observe(delay)
        self._carry_out(self.ledger.claim_answered(tasks, time.monotonic()))

    async def _heartbeat_loop(self) -> None:
        ok = True
        while True:
            await asyncio.sleep(self.times.renew_every if ok else self.times.retry_every)
            ok = await self._beat()
            if ok and self.ledger.fenced and (self._giving_back is None or self._giving_back.done()):
                # Off the beat: a fenced run's row may be locked elsewhere (its release waits for the
                # lock), and the next beat must not wait for that.
                self._giving_back = self._spawn(self._hand_back_fenced())

    async def _beat(self) -> bool:
        """Extend our row, and the own leases of the runs whose lease is due; stop the tools of
        those the database no longer gives us. False when the database did not answer in time."""
        renewal = self.ledger.begin_renewal(time.monotonic())
        due = [(run.key, run.task.lease_epoch) for run in renewal.due]
        try:
            # Bounded: an answer that does not come must not hold up the next attempt.
            extended, held, busy = await asyncio.wait_for(
                self.store.renew(self.owner, self.lease_ms, due, self.times.task_lease_ms),
                timeout=self.times.renew_every,
            )
        except TimeoutError:
            self.outage.lost("renewed its leases", Unavailable(f"no answer within {self.times.renew_every:.1f} s"))
            return False
        except Unavailable as exc:
            self.outage.lost("renewed its leases", exc)
            return False
        except Exception:
            log.exception("runner lease renewal failed")
            return False
        self.outage.back()
        commands = self.ledger.renewal_landed(renewal, extended=extended, held=held, busy=busy)
        if not extended:
            stopped = sum(1 for command in commands if isinstance(command, Stop))
            metrics.runner_fenced.inc(stopped)
            log.warning(
                "runner's row had lapsed (no heartbeat reached the database for a lease): %d running tool(s) "
                "stopped, their tasks go back (re-run or failed); publishing the runner afresh",
                stopped,
            )
        self._carry_out(commands)
        return True

    async def _fence_loop(self) -> None:
        """Stop the tools of runs whose lease could not be renewed in time, before the reaper could
        take their tasks: this process may not count on those leases any more."""
        while True:
            fenced, wait = self.ledger.tick(time.monotonic())
            if fenced:
                metrics.runner_fenced.inc(len(fenced))
                log.warning(
                    "runner could not renew the leases of %d task(s) for %.1f s: their tools are stopped and "
                    "their outcomes will not be written; the tasks go back (re-run or failed) once the database "
                    "answers or their leases run out",
                    len(fenced),
                    self.times.fence_after,
                )
                self._carry_out(fenced)
            await asyncio.sleep(wait)

    async def _hand_back_fenced(self) -> None:
        """The database answers again: give back the fenced runs' tasks at once (under their epochs;
        those the reaper took meanwhile are refused and dropped)."""
        back = self.ledger.fenced_to_hand_back(time.monotonic())
        if back is None:
            return
        try:
            answered = await asyncio.wait_for(self.records.hand_back(back), timeout=self.times.renew_every)
        except TimeoutError:
            return
        if answered:
            self.ledger.handed_back(back.tasks)

    # ---- shutdown ------------------------------------------------------------------------------

    def drain(self) -> None:
        """A shutdown began: claim nothing more; leases of running tasks are still renewed."""
        if not self.ledger.draining:
            self.ledger.drain()
            log.info("runner draining: %d task(s) running or recording their outcome, no new claims",
                     len(self.ledger.runs))  # fmt: skip

    async def stop(self, deadline: float | None = None) -> None:
        """Stop claiming; let running tasks finish until ``deadline`` (loop time), then hand what
        is left back (re-queue or fail) so none stays working."""
        self.drain()
        if self._tools_changed in self.registry.listeners:  # a change now must not publish us again
            self.registry.listeners.remove(self._tools_changed)
        running = self.runs.running()
        if running and deadline is not None:
            timeout = deadline - asyncio.get_running_loop().time()
            if timeout > 0:
                await asyncio.wait(running, timeout=timeout)
            left = sum(1 for job in running if not job.done())
            log.info("runner stopping: %d task(s) finished in the grace, %d handed back", len(running) - left, left)
        self.ledger.stop()
        self.records.stopping = True
        with contextlib.suppress(ValueError):
            self.hub.listeners.remove(self._on_event)
        await cancel_and_wait(*self._loops)
        running = self.runs.running()
        for job in running:
            job.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.ledger.fenced:  # give them back now rather than leave them to the reaper
            await self._hand_back_fenced()
        try:
            await self.store.withdraw(self.owner)
        except Exception as exc:  # its row lapses by itself (live_until)
            log.warning("runner could not withdraw its tools: %s", exc)
