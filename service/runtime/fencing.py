"""A runner's lease intervals: when to renew, when to give up on them (docs/decisions.md, "Fencing").

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
