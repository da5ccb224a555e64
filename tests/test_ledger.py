"""The runner's ledger (service/runtime/ledger.py), driven through interleavings of its events.

A model of the database stands beside it: the queue of unleased tasks, the creates and claims in
flight, the created events not yet delivered, and each task's lease epoch. Hypothesis sends the
events in every order it can find (creates straight to a slot and through the queue, claims read
before or after a create commits, answers lost, tools ending, beats, the clock moving on) and
checks after each step:

- a tenant never holds more than its share of the process's slots, and tools running never
  exceed the slots;
- a freed slot with queued work always leads to a claim or a start: whenever no claim is in
  flight, a slot is free, the runner's row is fresh, the last
  claim did not fail (the runner then tries again at its poll interval) and some tenant below its
  share has a queued task and every created event of that tenant has arrived, the ledger wants a
  claim now (the missed wake-up);
- nothing starts twice under one epoch, and every start holds a lease the model gave us;
- no run goes on past its fence.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from service.domain.task import Task, TaskStatus
from service.runtime.commands import (
    CLAIM_BATCH,
    CheckLease,
    Claim,
    Command,
    HandBack,
    LookUp,
    Publish,
    Reservation,
    Run,
    Start,
    Stop,
    key_of,
)
from service.runtime.fencing import LeaseTimes
from service.runtime.ledger import Ledger

TIMES = LeaseTimes.of(8_000)  # 1 s between beats, fenced after 6 s
TENANTS = ("a", "b", "c")
SUBJECTS = ("s1", "s2")
T0 = datetime(2026, 12, 7, tzinfo=UTC)


def task(tenant: str, subject: str, task_id: str, epoch: int) -> Task:
    return Task(tenant_id=tenant, task_id=task_id, subject=subject, tool="echo", status=TaskStatus.WORKING,
                status_message=None, ttl_ms=60_000, poll_interval_ms=1000, created_at=T0, last_updated_at=T0,
                lease_epoch=epoch)  # fmt: skip


@dataclass
class Queued:
    tenant: str
    subject: str
    task_id: str
    epoch: int


def model_claim(queue: list[Queued], claim: Claim, share: int) -> list[Queued]:
    """What claim_tasks picks: oldest first in turns per tenant, none past its share as held when sent."""
    room = {t: share - claim.held.get(t, 0) for t in {q.tenant for q in queue}}
    by_tenant: dict[str, list[Queued]] = {}
    for q in queue:
        if room[q.tenant] > 0:
            by_tenant.setdefault(q.tenant, []).append(q)
    picked: list[Queued] = []
    for turn in itertools.count():
        row = [rows[turn] for tenant, rows in by_tenant.items() if turn < len(rows) and turn < room[tenant]]
        if not row:
            break
        picked += row
    return picked[: claim.want]


class LedgerMachine(RuleBasedStateMachine):
    @initialize(concurrency=st.integers(1, 6), share=st.integers(1, 6))
    def setup(self, concurrency: int, share: int) -> None:
        self.ledger = Ledger(concurrency=concurrency, tenant_share=share, times=TIMES)
        self.share = self.ledger.tenant_share
        self.now = 100.0
        self.ledger.published(self.now)
        self.ids = itertools.count()
        self.queue: list[Queued] = []
        self.events: list[str] = []  # created events on their way
        self.epochs: dict[tuple[str, str], int] = {}
        self.leased: dict[tuple[str, str], int] = {}  # our leases as the database has them
        self.creates: list[tuple[Reservation, Task | None]] = []  # local creates in flight
        self.claim: Claim | None = None
        self.claimed: list[Queued] | None = None  # the claim's rows, once the database ran it
        self.running: list[Run] = []
        self.waiting: list[Run] = []  # tools waiting for an answer
        self.resuming: list[Run] = []  # answered, waiting for a slot
        self.recording: list[Run] = []
        self.started: set[tuple[tuple[str, str], int]] = set()
        self.outage = False

    # ---- carrying out commands -------------------------------------------------------------

    def carry_out(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Start):
                run = command.run
                token = (run.key, run.task.lease_epoch)
                assert token not in self.started, f"started twice under one epoch: {token}"
                assert self.leased.get(run.key) == run.task.lease_epoch, "started without our lease"
                self.started.add(token)
                self.running.append(run)
            elif isinstance(command, HandBack):
                for t in command.tasks:
                    if self.leased.get(key_of(t)) == t.lease_epoch:
                        self.requeue(t)
            elif isinstance(command, Stop):
                self.cancelled(command.run)
            elif isinstance(command, Publish):
                self.ledger.published(self.now)
            elif isinstance(command, LookUp | CheckLease):
                pass  # not modelled: the rules below answer creates and cancels themselves
        self.wake_resumed()  # as the runner does after every event it carried out

    def requeue(self, t: Task) -> None:
        key = key_of(t)
        del self.leased[key]
        self.epochs[key] = t.lease_epoch + 1
        self.queue.append(Queued(t.tenant_id, t.subject, t.task_id, t.lease_epoch + 1))
        self.events.append(t.tenant_id)

    def cancelled(self, run: Run) -> None:
        """The runner cancels the run's job: it hands back (at shutdown) or keeps it fenced, then ends."""
        for runs in (self.running, self.waiting, self.resuming):
            if run not in runs:
                continue
            runs.remove(run)
            back = self.ledger.run_cancelled(run, self.now)
            if back is not None:
                self.carry_out([back])
            self.ledger.run_ended(run)
            self.wake_resumed()
            return

    # ---- creates ---------------------------------------------------------------------------

    @rule(tenant=st.sampled_from(TENANTS), subject=st.sampled_from(SUBJECTS))
    def create_queued(self, tenant: str, subject: str) -> None:
        """Another replica (or this one, without a slot) creates an unleased task."""
        task_id = f"t{next(self.ids)}"
        self.epochs[(tenant, task_id)] = 0
        self.queue.append(Queued(tenant, subject, task_id, 0))
        self.events.append(tenant)

    @rule(tenant=st.sampled_from(TENANTS), subject=st.sampled_from(SUBJECTS), refused=st.booleans())
    def create_here(self, tenant: str, subject: str, refused: bool) -> None:
        reservation = self.ledger.reserve(tenant, self.now)
        if reservation is None:
            self.create_queued(tenant, subject)
            return
        assert self.ledger.held_by(tenant) <= self.share
        task_id = f"t{next(self.ids)}"
        created = None if refused else task(tenant, subject, task_id, 0)
        if created is not None:  # committed at once; its answer comes back later
            self.leased[key_of(created)] = 0
            self.epochs[key_of(created)] = 0
        self.creates.append((reservation, created))

    @precondition(lambda self: self.creates)
    @rule(data=st.data())
    def create_answered(self, data: st.DataObject) -> None:
        reservation, created = self.creates.pop(data.draw(st.integers(0, len(self.creates) - 1)))
        self.carry_out(self.ledger.adopted(reservation, created, self.now))

    @precondition(lambda self: self.events)
    @rule(data=st.data())
    def created_event_arrives(self, data: st.DataObject) -> None:
        self.ledger.created(self.events.pop(data.draw(st.integers(0, len(self.events) - 1))))

    # ---- claims ----------------------------------------------------------------------------

    @precondition(lambda self: self.claim is None)
    @rule()
    def send_claim(self) -> None:
        self.outage = False
        self.claim = self.ledger.begin_claim(self.now)
        if self.claim is not None:
            assert self.claim.want <= CLAIM_BATCH
            for _tenant, n in self.claim.held.items():
                assert n <= self.share

    @precondition(lambda self: self.claim is not None and self.claimed is None)
    @rule()
    def database_runs_the_claim(self) -> None:
        assert self.claim is not None
        self.claimed = model_claim(self.queue, self.claim, self.share)
        for q in self.claimed:
            self.queue.remove(q)
            self.epochs[(q.tenant, q.task_id)] = q.epoch + 1
            self.leased[(q.tenant, q.task_id)] = q.epoch + 1

    @precondition(lambda self: self.claimed is not None)
    @rule()
    def claim_answered(self) -> None:
        assert self.claimed is not None
        tasks = [task(q.tenant, q.subject, q.task_id, q.epoch + 1) for q in self.claimed]
        self.claim, self.claimed = None, None
        self.carry_out(self.ledger.claim_answered(tasks, self.now))
        self.wake_resumed()

    @precondition(lambda self: self.claim is not None and self.claimed is None)
    @rule()
    def claim_got_no_answer(self) -> None:
        """The claim failed before it read anything (an outage): nothing was leased."""
        self.claim = None
        self.ledger.claim_failed()
        self.wake_resumed()
        self.outage = True  # the runner tries again at its poll interval, not at once

    # ---- runs ------------------------------------------------------------------------------

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def tool_ends(self, data: st.DataObject) -> None:
        run = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.ledger.tool_called(run)
        self.ledger.tool_ended(run)
        self.recording.append(run)
        self.wake_resumed()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def tool_asks(self, data: st.DataObject) -> None:
        """Issue 42 §3: its tool waits for an answer, giving its slot back within the allowance."""
        run = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        self.ledger.tool_called(run)
        self.ledger.run_waiting(run)
        if run.waiting:
            self.running.remove(run)
            self.waiting.append(run)
        self.wake_resumed()

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def answer_arrives(self, data: st.DataObject) -> None:
        run = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        (self.running if self.ledger.run_resuming(run) else self.resuming).append(run)

    def wake_resumed(self) -> None:
        """What the runner does after every event: runs given a slot again go on."""
        for run in self.ledger.take_resumed():
            self.resuming.remove(run)
            self.running.append(run)

    @precondition(lambda self: self.recording)
    @rule(data=st.data())
    def outcome_lands(self, data: st.DataObject) -> None:
        run = self.recording.pop(data.draw(st.integers(0, len(self.recording) - 1)))
        if self.leased.get(run.key) == run.task.lease_epoch:
            del self.leased[run.key]
        self.ledger.run_ended(run)
        self.wake_resumed()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def task_cancelled_by_its_client(self, data: st.DataObject) -> None:
        run = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        self.leased.pop(run.key, None)
        for command in self.ledger.cancel_seen(run.key):
            assert isinstance(command, CheckLease)
            self.carry_out(self.ledger.lease_checked(command.run, None))

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def no_tenant_holds_more_than_its_share(self) -> None:
        for tenant in TENANTS:
            assert self.ledger.held_by(tenant) <= self.share, (tenant, self.ledger.held())
        tools = Counter(run.task.tenant_id for run in self.ledger.runs.values() if run.holds_slot)
        assert sum(tools.values()) <= self.ledger.concurrency

    @invariant()
    def what_waits_is_bounded_and_an_answered_run_gets_a_free_slot(self) -> None:
        ledger = self.ledger
        waits = Counter(run.task.tenant_id for run in ledger.runs.values() if run.waiting)
        assert all(n <= self.share for n in waits.values()), waits
        assert sum(waits.values()) <= ledger.concurrency
        assert all(not run.holds_slot for run in self.waiting + self.resuming)
        assert set(map(id, self.resuming)) == set(map(id, ledger.resumers)), "an answered run lost its turn"
        if ledger.free > 0:
            assert all(ledger.at_share(r.task.tenant_id) for r in ledger.resumers), "a free slot no answered run took"

    @invariant()
    def a_free_slot_with_queued_work_claims(self) -> None:
        ledger = self.ledger
        if self.claim is not None or self.outage or ledger.row_stale(self.now) or ledger.free <= 0:
            return
        # Tenants below their share with queued work whose created events have all arrived.
        waiting = {
            q.tenant for q in self.queue if ledger.held_by(q.tenant) < self.share and q.tenant not in self.events
        }
        assert not waiting or ledger.claim_due, f"queued work of {sorted(waiting)} and a free slot, but no claim"


class LeaseMachine(LedgerMachine):
    """The same, with the clock moving on: beats that land or find the row lapsed, fences."""

    # ---- time, beats, fences -----------------------------------------------------------------

    @rule(seconds=st.sampled_from([0.1, 0.5, 1.0, 2.5]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        stops, _wait = self.ledger.tick(self.now)
        self.carry_out(list(stops))

    @rule(extended=st.booleans())
    def beat(self, extended: bool) -> None:
        renewal = self.ledger.begin_renewal(self.now)
        held = {run.key for run in renewal.due if self.leased.get(run.key) == run.task.lease_epoch}
        self.carry_out(self.ledger.renewal_landed(renewal, extended=extended, held=held, busy=()))

    @rule()
    def fenced_runs_go_back(self) -> None:
        back = self.ledger.fenced_to_hand_back(self.now)
        if back is not None:
            self.carry_out([back])
            self.ledger.handed_back(back.tasks)

    @invariant()
    def no_run_goes_on_past_its_fence(self) -> None:
        for run in self.ledger.runs.values():
            if not run.tool_done and not run.fenced:
                assert run.renewed_at + TIMES.fence_after > self.now - 2.5 - 1e-9


SETTINGS = settings(
    max_examples=600, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
LedgerMachine.TestCase.settings = SETTINGS
LeaseMachine.TestCase.settings = SETTINGS
test_claims_creates_and_slots_keep_their_invariants_whatever_the_order_of_events = LedgerMachine.TestCase
test_leases_beats_and_fences_keep_their_invariants_whatever_the_order_of_events = LeaseMachine.TestCase


def ledger(concurrency: int = 4, share: int = 2) -> Ledger:
    led = Ledger(concurrency=concurrency, tenant_share=share, times=TIMES)
    led.published(0.0)
    return led


def test_a_create_whose_covering_row_extension_is_too_old_when_it_lands_does_not_start() -> None:
    """A slot reserved under one extension of the runner's row, adopted after that extension
    stopped covering it, goes back unstarted (the reaper may hold the task by then)."""
    led = ledger()
    reservation = led.reserve("a", 1.0)
    assert reservation is not None
    late = TIMES.fence_after + 2.0
    (command,) = led.adopted(reservation, task("a", "s", "t1", 0), late)
    assert isinstance(command, HandBack)
    assert command.fenced == 1
    assert command.never_started == {("a", "t1")}
    assert "lease ran out before the task started" in command.why
    assert not led.runs
    assert led.held() == {}


def test_a_runner_whose_row_looks_stale_claims_nothing_until_a_beat_lands() -> None:
    led = ledger()
    now = TIMES.fence_after  # no beat landed for half the fence time and more
    led.created("a")
    assert led.claim_due
    assert led.begin_claim(now) is None
    assert not led.claim_due
    renewal = led.begin_renewal(now)
    led.renewal_landed(renewal, extended=True, held=(), busy=())
    assert led.claim_due
    assert led.begin_claim(now) is not None


def test_a_created_event_during_a_claim_is_decided_once_its_answer_is_counted() -> None:
    """The claim read the queue before the create committed: its answer (nothing) must not leave
    the new task waiting for the poll with every slot free."""
    led = ledger(concurrency=4, share=2)
    claim = led.begin_claim(1.0)
    assert claim is not None
    led.created("a")  # while the claim is in flight
    assert not led.claim_due
    led.claim_answered([], 1.1)
    assert led.claim_due


def test_a_slot_freed_while_a_full_claim_is_in_flight_claims_again_at_once() -> None:
    """The slot found no backlog to wake for (the last claim had emptied the queue); the claim's
    answer, full, says more may be queued: the freed slot claims now, not at the poll."""
    led = ledger(concurrency=2, share=2)
    assert led.begin_claim(1.0) is not None
    (start,) = led.claim_answered([task("a", "s", "t1", 1)], 1.0)  # fewer than asked: no backlog
    assert isinstance(start, Start)
    assert not led.backlog
    claim = led.begin_claim(2.0)
    assert claim is not None
    assert claim.want == 1
    led.tool_ended(start.run)  # while the claim is in flight
    assert not led.claim_due
    led.claim_answered([task("b", "s", "t2", 1)], 2.1)  # full
    assert led.claim_due
    assert led.free == 1


def test_a_tenant_at_its_share_wakes_no_claim_and_its_freed_slot_claims() -> None:
    led = ledger(concurrency=4, share=1)
    claim = led.begin_claim(1.0)
    assert claim is not None
    (start,) = led.claim_answered([task("a", "s", "t1", 1)], 1.1)
    assert isinstance(start, Start)
    led.begin_claim(1.2)  # nothing more queued
    led.claim_answered([], 1.3)
    led.created("a")
    assert not led.claim_due
    assert led.backlog
    led.tool_ended(start.run)
    assert led.claim_due


def test_a_beat_that_finds_the_row_lapsed_stops_every_run_and_publishes_afresh() -> None:
    led = ledger()
    claim = led.begin_claim(1.0)
    assert claim is not None
    commands = led.claim_answered([task("a", "s", "t1", 1), task("b", "s", "t2", 1)], 1.1)
    runs = [c.run for c in commands if isinstance(c, Start)]
    out = led.renewal_landed(led.begin_renewal(2.0), extended=False, held=(), busy=())
    assert {c.run.key for c in out if isinstance(c, Stop) and c.fenced} == {r.key for r in runs}
    assert isinstance(out[-1], Publish)


def test_a_run_whose_row_is_locked_elsewhere_is_not_covered_by_the_beat() -> None:
    led = ledger()
    claim = led.begin_claim(1.0)
    assert claim is not None
    (start,) = led.claim_answered([task("a", "s", "t1", 1)], 1.0)
    run = start.run
    covered = run.renewed_at
    now = 1.0 + TIMES.claim_renew_after + 0.01  # its claim lease is due for renewal
    renewal = led.begin_renewal(now)
    assert run in renewal.due
    assert led.renewal_landed(renewal, extended=True, held=(), busy={run.key}) == []
    assert run.renewed_at == covered  # not covered by this beat: a lock held past the fence stops it alone
    stops, _ = led.tick(covered + TIMES.fence_after)
    assert [s.run for s in stops] == [run]


@pytest.mark.parametrize("stopping", [False, True])
def test_a_run_cancelled_before_its_tool_was_called_goes_back_whatever_its_tool(stopping: bool) -> None:
    led = ledger()
    claim = led.begin_claim(1.0)
    assert claim is not None
    (start,) = led.claim_answered([task("a", "s", "t1", 1)], 1.0)
    if stopping:
        led.stop()
    else:
        (stop,) = led.tick(1.0 + TIMES.fence_after)[0]
        assert stop.fenced
    back = led.run_cancelled(start.run, 9.0)
    led.run_ended(start.run)
    if stopping:
        assert back is not None
        assert back.never_started == {("a", "t1")}
    else:
        back = led.fenced_to_hand_back(9.0)
        assert back is not None
        assert back.never_started == {("a", "t1")}
    assert led.held() == {}


def test_a_call_already_running_takes_a_slot_even_when_none_is_free() -> None:
    led = ledger(concurrency=1, share=1)
    assert led.reserve("a", 1.0) is not None
    assert led.reserve("a", 1.0) is None
    running = led.reserve("a", 1.0, running=True)
    assert running is not None
    (start,) = led.adopted(running, task("a", "s", "t1", 0), 1.0)
    assert isinstance(start, Start)
    assert start.run.tool_started


def test_nothing_is_reserved_while_draining() -> None:
    led = ledger()
    led.drain()
    assert led.reserve("a", 1.0) is None
    assert led.begin_claim(1.0) is None


def test_a_lost_create_answer_for_a_task_already_running_here_starts_nothing() -> None:
    """The look-up after a lost answer finds the row leased to us, but the task runs here already
    (its claim took it): the look-up only gives the reserved slot back."""
    led = ledger()
    assert led.begin_claim(1.0) is not None
    (start,) = led.claim_answered([task("a", "s", "t1", 1)], 1.0)
    reservation = led.reserve("a", 1.1)
    assert reservation is not None
    assert led.adopted(reservation, task("a", "s", "t1", 1), 1.2) == []
    assert led.runs[("a", "t1")] is start.run
    assert led.held() == {"a": 1}
