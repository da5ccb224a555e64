"""A runner's reckoning of its leases: when to renew, when to give up on them (docs/decisions.md, "Fencing").

Each run keeps the fencing token it was given (the runner's owner name and the task's lease
epoch); the database accepts its writes only while that token holds the lease. A lease holds while
both the task's own lease (four leases long, renewed once it is a lease old; a claim sets a lease
and a half, which the first beat half a lease later extends to four) and the runner's row
(extended by every heartbeat for all its runs at once) hold. The runner's own part is time: it
beats every eighth of the lease (an attempt waits as long for its answer, and attempts come a
quarter of that apart while they fail), and a run not covered by a successful beat for three
quarters of the lease is fenced (its tool stopped, nothing of it written), a quarter of the lease
before the reaper could take the task. So a database blip of up to 3/4 - 1/8 - 1/8 - 1/32 (about
47 %) of the lease changes nothing, whatever its phase.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from service.domain.task import Task
from service.domain.values import frozen

RENEW_EVERY = 1 / 8
RETRY_EVERY = RENEW_EVERY / 4
FENCE_AFTER = 3 / 4
# A task's own lease, in leases: what a task a live runner no longer runs waits before the reaper
# takes it. Renewed once it is one lease old, so it always has three left when a beat counts it.
TASK_LEASE = 4
TASK_RENEW_AFTER = 1
# A claimed task's own lease until the first beat after the claim extends it to TASK_LEASE: a
# claim whose answer was lost (committed, never heard of) leaves its tasks leased to a live
# runner that does not run them, and they wait for this lease, not four. Longer than the fence
# (a run not covered by a beat stops at FENCE_AFTER), so it never binds a run that goes on.
CLAIM_LEASE = 1.5
# A claimed run's own lease is renewed by the first beat this long after the claim: a task that
# ends sooner (most) costs no renewal. The last beat that leaves it alone is sent before this, so
# a run no beat covers after it is fenced by CLAIM_RENEW_AFTER + FENCE_AFTER, before CLAIM_LEASE.
CLAIM_RENEW_AFTER = 0.5
assert CLAIM_RENEW_AFTER + FENCE_AFTER < CLAIM_LEASE
# The end of the name of a runner whose row is the lease on its tasks (lease_lapsed in
# alembic/schema.sql reads it): a runner of an earlier release renews every task's own lease and
# is judged by those alone, whatever becomes of its row.
ROW_LEASE = "+row"


@frozen
class LeaseTimes:
    """The runner's intervals, in seconds, for a lease of ``lease_ms``."""

    renew_every: float
    retry_every: float
    fence_after: float
    task_lease_ms: int  # the tasks' own lease
    task_renew_after: float  # a run's task lease is renewed by the first beat this long after it was set
    claim_lease_ms: int  # a claimed task's own lease until its first renewal
    claim_renew_after: float  # a claimed run's own lease is renewed by the first beat this long after the claim

    @classmethod
    def of(cls, lease_ms: int) -> LeaseTimes:
        lease_s = lease_ms / 1000
        return cls(
            lease_s * RENEW_EVERY, lease_s * RETRY_EVERY, lease_s * FENCE_AFTER, lease_ms * TASK_LEASE,
            lease_s * TASK_RENEW_AFTER, int(lease_ms * CLAIM_LEASE), lease_s * CLAIM_RENEW_AFTER,
        )  # fmt: skip

    @property
    def claim_timeout(self) -> float:
        """A claim answered within this leaves its runs at least half the lease before the fence."""
        return self.fence_after / 3


@dataclass(slots=True, eq=False)
class Run:
    """One task a runner executes, with the lease it holds for it."""

    task: Task  # its lease_epoch and the runner's owner name are the run's fencing token
    job: asyncio.Task[None]
    # Monotonic time at which the last statement that made the lease hold for at least a lease was
    # sent (claim, create, a beat): the database set both expiries later than this plus the lease.
    renewed_at: float
    # Monotonic time at which the task's own lease was last set (claim, create, its renewal).
    task_lease_set_at: float
    tool_done: bool = False  # the outcome is in hand: nothing left to stop, only its write to offer
    fenced: bool = False  # stopped for want of a renewal: nothing of it is written any more
    holds_slot: bool = True  # its tool runs (or is about to): it counts against the runner's slots
    # Its tool was called (or the call began in its request): a hand-back then re-runs the task
    # only if the tool says it may. Until then it goes back to the queue whatever its tool.
    tool_started: bool = False


def overdue(runs: Iterable[Run], now: float, times: LeaseTimes) -> tuple[list[Run], float]:
    """The runs whose tools must stop now, and how long until the next one might (at most an
    eighth of the fence time, so a run started meanwhile is looked at soon enough)."""
    due: list[Run] = []
    wake = times.fence_after / 8
    for run in runs:
        if run.tool_done or run.fenced:
            continue
        left = run.renewed_at + times.fence_after - now
        if left <= 0:
            due.append(run)
        else:
            wake = min(wake, left)
    return due, max(wake, 0.01)
