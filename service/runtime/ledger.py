"""The runner's ledger: slots per tenant, reservations, the claim in flight, leases and fences.

Pure bookkeeping, with no asyncio, no I/O and no clock of its own. The runner (``runner.py``)
tells it what happened, each event with the monotonic time it was read, and carries out the
commands it answers with. Every decision about which task may start here, when to claim, which
runs a beat covers and which tools must stop is made here, so each is tested without a database
or an event loop (``tests/test_ledger.py`` drives the ledger through thousands of interleavings).

Slots. A slot is a tool running here. A tenant holds at most ``tenant_share`` of them, counting
the tools it runs, the creates promised a slot (reservations) and its outcome writes waiting
beyond its share. A claim in flight counts as what it may still bring each tenant. Outcome writes
beyond ``concurrency`` waiting at once count as slots in use again, so a database that records
slower than tools end cannot pile up runs in memory unbounded.

Wake-ups. ``claim_due`` says a claim should be sent now rather than at the next poll: a task was
created for a tenant below its share, or a slot freed while queued work may be left (the
backlog), or the runner's row was published afresh. A created event that arrives while a claim
is in flight is decided once that claim's answer is counted (the claim may have read the queue
before the create committed).

Leases (docs/decisions.md, "Fencing"). A run's fencing token is its task's lease epoch. A run is
covered until ``renewed_at + fence_after``: ``renewed_at`` is when the last statement that made
its lease hold for at least a lease was sent (its claim or create, or a beat that extended the
runner's row and found the run's own lease with time left or renewed it). A run no beat covered
for ``fence_after`` is fenced: its tool stops and nothing of it is written. The runner's row
(extended by every beat) is the lease on all its runs; a beat that finds it lapsed stops every
run and has the row published afresh, for new work only.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from service.domain.task import Task
from service.runtime.commands import (
    CLAIM_BATCH,
    CheckLease,
    Claim,
    Command,
    HandBack,
    Publish,
    Renewal,
    Run,
    Start,
    Stop,
    TaskKey,
    key_of,
    never_started,
)
from service.runtime.fencing import LeaseTimes
from service.runtime.reservations import Reservations
from service.runtime.slots import Slots
from service.runtime.waiting import WaitingRuns


@dataclass(slots=True)
class _ClaimInFlight:
    claim: Claim
    created: set[str] = field(default_factory=set)  # tenants whose tasks were created meanwhile
    freed: bool = False  # a slot was freed meanwhile


class Ledger(Reservations, WaitingRuns):
    """The runner's state, moved only by the events below."""

    def __init__(self, *, concurrency: int, tenant_share: int, times: LeaseTimes) -> None:
        self.concurrency = concurrency
        self.tenant_share = max(1, min(tenant_share, concurrency))
        self.times = times
        self.runs: dict[TaskKey, Run] = {}
        self.slots = Slots(concurrency, self.tenant_share)
        self._claim: _ClaimInFlight | None = None
        # Fenced runs whose leases we still hold, handed back once the database answers again:
        # when each was fenced and whether its tool never started.
        self.fenced: dict[TaskKey, tuple[Task, float, bool]] = {}
        self.row_sent = -math.inf  # when the last statement that extended our row while it held was sent
        self.backlog = True  # queued tasks may wait that a freed slot should claim
        self.claim_due = True  # a claim should go out now, not at the next poll
        self._claim_after_beat = False  # a claim was held back because our row looked stale
        self.draining = False
        self.stopping = False
        self.resumers: list[Run] = []
        self.resumed: list[Run] = []

    # ---- what is held ----------------------------------------------------------------------

    @property
    def busy(self) -> int:
        """Slots in use: tools running, plus outcome writes beyond ``concurrency`` waiting."""
        return self.slots.busy

    @property
    def free(self) -> int:
        """Slots neither in use nor promised (to creates or to the claim in flight)."""
        want = self._claim.claim.want if self._claim is not None else 0
        return self.concurrency - self.busy - self.slots.reserved.total - want

    @property
    def claiming(self) -> bool:
        return self._claim is not None

    def held_by(self, tenant_id: str) -> int:
        return self.slots.held_by(tenant_id)

    def held(self) -> dict[str, int]:
        return self.slots.held()

    def at_share(self, tenant_id: str) -> bool:
        """Would one more slot take the tenant past its share, counting what the claim in flight
        may still give it?"""
        held = self.held_by(tenant_id)
        if self._claim is not None:
            claim = self._claim.claim
            held += max(0, min(claim.want, self.tenant_share - claim.held.get(tenant_id, 0)))
        return held >= self.tenant_share

    def row_stale(self, now: float) -> bool:
        """No beat landed for half the fence time: a lease taken now might not be covered by the
        time its statement is answered, so none is taken."""
        return now - self.row_sent >= self.times.fence_after / 2

    # ---- the runner's row ------------------------------------------------------------------

    def published(self, sent: float) -> None:
        """Our row was published (at start, or afresh after it lapsed) by a statement sent at ``sent``."""
        self.row_sent = sent
        self._claim_after_beat = False
        self.claim_due = True

    def drain(self) -> None:
        self.draining = True

    def stop(self) -> None:
        self.stopping = True

    # ---- claims ------------------------------------------------------------------------------

    def created(self, tenant_id: str) -> None:
        """A task of ``tenant_id`` was queued (its created event arrived)."""
        if self._claim is not None:
            # The claim in flight may have read the queue before this create committed, and what
            # it brings the tenant is not known yet: decided once its answer is counted.
            self._claim.created.add(tenant_id)
        else:
            self._decide_created(tenant_id)

    def _decide_created(self, tenant_id: str) -> None:
        if self.at_share(tenant_id):
            # A claim would skip the tenant's rows after walking past every one of them: one of
            # its slots freed here claims again instead (the backlog).
            self.backlog = True
        else:
            self.claim_due = True

    def begin_claim(self, now: float) -> Claim | None:
        """The claim to send now, or None. Clears ``claim_due``: a wake-up arriving while the
        claim is in flight is not lost (it sets it again)."""
        self.claim_due = False
        if self.draining or self.stopping or self._claim is not None:
            return None
        free = self.free
        if free <= 0:
            self.backlog = True  # whatever woke us waits for a slot
            return None
        if self.row_stale(now):
            # What it claimed could not start (runs our row may no longer cover are handed back,
            # each costing the task an attempt): claim once a beat lands.
            self._claim_after_beat = True
            return None
        running = Counter((run.task.tenant_id, run.task.subject) for run in self.runs.values() if run.holds_slot)
        claim = Claim(min(free, CLAIM_BATCH), self.held(), dict(running), now, self.row_sent)
        self._claim = _ClaimInFlight(claim)
        return claim

    def claim_answered(self, tasks: Iterable[Task], now: float) -> list[Command]:
        """The claim in flight brought ``tasks`` (leased to us by it)."""
        assert self._claim is not None
        claim, late, freed = self._claim.claim, self._claim.created, self._claim.freed
        self._claim = None
        tasks = list(tasks)
        held = dict(claim.held)
        for task in tasks:
            held[task.tenant_id] = held.get(task.tenant_id, 0) + 1
        # A full claim, or a tenant at its share whose queued tasks it skipped: there may be more,
        # so a freed slot claims again.
        self.backlog = len(tasks) == claim.want or any(n >= self.tenant_share for n in held.values())
        commands: list[Command] = []
        started = 0
        for task in tasks:
            # The claim reads our row, never extends it.
            out = self._start(task, leased_at=claim.sent, covered_since=min(claim.sent, claim.row_sent), now=now)
            for command in out:
                if isinstance(command, Start):
                    started += 1
                    # Its own lease is the short claim lease: the first beat half a lease after the
                    # claim extends it, as if it had been set earlier (fencing.py, CLAIM_RENEW_AFTER).
                    command.run.task_lease_set_at = (
                        claim.sent + self.times.claim_renew_after - self.times.task_renew_after
                    )
            commands += out
        if started >= CLAIM_BATCH and self.free > 0:
            self.claim_due = True  # a full batch: more may be queued, and slots are free
        if self.backlog and freed:
            # A slot freed while the claim was in flight found the backlog as the claim's answer
            # had yet to set it: the answer says there may be more, so that slot claims now.
            self.claim_due = True
        self._grant_resumers()  # what the claim did not bring is free again: answered runs first
        for tenant_id in sorted(late):
            self._decide_created(tenant_id)
        return commands

    def claim_failed(self) -> None:
        """The claim in flight got no answer (or an error): nothing to count, so each create it
        held back is decided as if it had brought nothing."""
        assert self._claim is not None
        late = self._claim.created
        self._claim = None
        self._grant_resumers()  # the slots it held are free again: answered runs first
        for tenant_id in sorted(late):
            self._decide_created(tenant_id)

    # ---- runs --------------------------------------------------------------------------------

    def _start(
        self, task: Task, *, leased_at: float, covered_since: float, now: float, tool_started: bool = False
    ) -> list[Command]:
        """A run of ``task``, unless the lease it came with may have lapsed already (our row did,
        say): then it goes back unstarted."""
        if covered_since + self.times.fence_after <= now:
            return [HandBack((task,), "re-queued: the runner's lease ran out before the task started",
                             never_started(task, not tool_started), fenced=1)]  # fmt: skip
        run = Run(task, covered_since, leased_at, tool_started=tool_started)
        self.runs[run.key] = run
        self.slots.running.add(task.tenant_id, 1)
        return [Start(run)]

    def tool_called(self, run: Run) -> None:
        """The run's tool is being called: a hand-back now re-runs it only if its tool says so."""
        run.tool_started = True

    def tool_ended(self, run: Run) -> None:
        """The run's tool returned: its slot is free, its outcome goes on to the database."""
        run.tool_done = True
        self.slots.recording.add(run.task.tenant_id, 1)
        self._give_slot(run)

    def _give_slot(self, run: Run) -> None:
        if not run.holds_slot:
            return
        run.holds_slot = False
        tenant = run.task.tenant_id
        self.slots.running.add(tenant, -1)
        self._slot_freed()

    def _slot_freed(self) -> None:
        if self._claim is not None:
            self._claim.freed = True
        self._grant_resumers()
        if self.backlog:
            self.claim_due = True

    def run_cancelled(self, run: Run, now: float) -> HandBack | None:
        """The run's job was cancelled: at shutdown, the hand-back to carry out; a fenced run is
        kept to hand back once the database answers. A run stopped before its tool was called
        goes back to the queue whatever its tool: nothing of it ran."""
        if self.stopping:
            return HandBack((run.task,), "re-queued: the runner was shut down",
                            never_started(run.task, not run.tool_started))  # fmt: skip
        if run.fenced:
            self.fenced[run.key] = (run.task, now, not run.tool_started)
        return None

    def run_ended(self, run: Run) -> None:
        """The run is over (its outcome written or refused, or it was handed back)."""
        if self.runs.get(run.key) is run:
            del self.runs[run.key]
        self._wait_ended(run)
        if run.tool_done:
            tenant = run.task.tenant_id
            self.slots.recording.add(tenant, -1)
            self._slot_freed()
        self._give_slot(run)

    # ---- cancels and deletes announced -------------------------------------------------------

    def cancel_seen(self, key: TaskKey) -> list[Command]:
        """An event says the task was cancelled or deleted: a hint anyone who may NOTIFY could
        send, so the row decides."""
        run = self.runs.get(key)
        return [CheckLease(run)] if run is not None else []

    def lease_checked(self, run: Run, epoch: int | None) -> list[Command]:
        """The row of a running task, re-read: still leased to us under ``epoch`` (None: not ours)."""
        if self.runs.get(run.key) is not run or (epoch is not None and epoch == run.task.lease_epoch):
            return []
        return [] if run.tool_done else [Stop(run, fenced=False)]

    def resync(self) -> None:
        """Events may have been missed (cancels, deletes): the next beat reads every run's row."""
        for run in self.runs.values():
            run.task_lease_set_at = -math.inf
        self.claim_due = True

    # ---- beats and fences --------------------------------------------------------------------

    def begin_renewal(self, now: float) -> Renewal:
        runs = tuple(run for run in self.runs.values() if not run.fenced)
        due = tuple(run for run in runs if now - run.task_lease_set_at >= self.times.task_renew_after)
        return Renewal(runs, due, now)

    def renewal_landed(
        self, renewal: Renewal, *, extended: bool, held: Collection[TaskKey], busy: Collection[TaskKey]
    ) -> list[Command]:
        """The beat was answered: whether it ``extended`` our row, the due runs whose own leases
        it renewed (``held``), and those still ours whose rows were locked elsewhere (``busy``)."""
        if not extended:
            return self._row_lapsed()
        sent = renewal.sent
        self.row_sent = max(self.row_sent, sent)
        if self._claim_after_beat:
            self._claim_after_beat = False
            self.claim_due = True
        due = {run.key for run in renewal.due}
        commands: list[Command] = []
        for run in renewal.runs:
            if self.runs.get(run.key) is not run:
                continue
            if run.key not in due:  # its own lease has three leases left: the row was all it needed
                run.renewed_at = max(run.renewed_at, sent)
            elif run.key in held:
                run.renewed_at = max(run.renewed_at, sent)
                run.task_lease_set_at = sent
            elif run.key in busy:
                # Its row was locked elsewhere: not renewed, so not covered by this beat either. It
                # stays due; a lock held past the fence stops this run alone.
                continue
            elif not run.tool_done:  # cancelled, expired, or the lease was taken
                commands.append(Stop(run, fenced=False))
        return commands

    def _row_lapsed(self) -> list[Command]:
        """Our row had lapsed (no beat landed for a lease): the reaper may take any task we run,
        so every run still going stops now, as a fence would, and the row is published afresh,
        for new work only (a revived row must not cover old runs)."""
        commands: list[Command] = []
        for run in self.runs.values():
            if not run.tool_done and not run.fenced:
                run.fenced = True
                commands.append(Stop(run, fenced=True))
        commands.append(Publish())
        return commands

    def tick(self, now: float) -> tuple[list[Stop], float]:
        """Fence the runs no beat covered for ``fence_after``, before the reaper could take their
        tasks; and how long until the next might be due (at most an eighth of the fence time)."""
        fenced: list[Stop] = []
        wait = self.times.fence_after / 8
        for run in self.runs.values():
            if run.tool_done or run.fenced:
                continue
            left = run.renewed_at + self.times.fence_after - now
            if left <= 0:
                run.fenced = True
                fenced.append(Stop(run, fenced=True))
            else:
                wait = min(wait, left)
        return fenced, max(wait, 0.01)

    def fenced_to_hand_back(self, now: float) -> HandBack | None:
        """The fenced runs' tasks whose leases may still be ours, to give back now the database
        answers; older ones (lapsed by their own lease) are the reaper's and are forgotten."""
        limit = self.times.task_lease_ms / 1000 + self.times.fence_after
        for key, (_task, at, _never) in list(self.fenced.items()):
            if now - at > limit:
                del self.fenced[key]
        if not self.fenced:
            return None
        tasks = tuple(task for task, _at, _never in self.fenced.values())
        never = frozenset(key for key, (_task, _at, never_started) in self.fenced.items() if never_started)
        return HandBack(tasks, "re-queued: the runner lost the database", never)

    def handed_back(self, tasks: Iterable[Task]) -> None:
        for task in tasks:
            self.fenced.pop(key_of(task), None)
