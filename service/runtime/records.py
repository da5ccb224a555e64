"""What a run writes: its outcome, a failure when that cannot be stored, and hand-backs.

Every write carries the run's fencing token (the runner's owner name and the task's lease epoch)
and lands only while that still holds the lease; a refused write is final. Outcomes go through
group commit (``finish``: with their audit events and wake-ups, in one statement with the outcomes
of other tasks finishing meanwhile) and are retried while the database is away: a task never
fails because its result could not be stored once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from service.domain.errors import Unavailable
from service.domain.task import FailureReason, Outcome, Task, TaskStatus
from service.observability import metrics
from service.runtime.commands import HandBack, key_of
from service.runtime.handback import count_handed_back, hand_back
from service.store.batch import Batcher
from service.store.requests import FinishRequest, HandBackRequest
from service.store.runners import RunnerStore

log = logging.getLogger(__name__)


class Outage:
    """One log line when the database goes away, not one per attempt; one when it is back."""

    def __init__(self, retry_s: float) -> None:
        self.ok = True
        self.retry_s = retry_s

    def lost(self, what: str, exc: Exception) -> None:
        if self.ok:
            self.ok = False
            log.warning("runner lost the database while it %s: %s; retrying every %.1f s", what, exc, self.retry_s)

    def back(self) -> None:
        if not self.ok:
            self.ok = True
            log.warning("runner reached the database again")


class RunRecords:
    """The writes of one runner's runs, under ``owner``."""

    def __init__(self, store: RunnerStore, owner: str, outage: Outage) -> None:
        self.store = store
        self.owner = owner
        self.outage = outage
        self.stopping = False  # a shutdown: an outcome still unwritten is not retried any more
        self._finishes = Batcher(store.finish, name="finish")

    async def finish(self, task: Task, outcome: Outcome) -> None:
        """Record the outcome, retried while the database is away, under the run's fencing token:
        once another runner took the task over it is refused, and a refusal is final."""
        request = FinishRequest.of(task.tenant_id, task.task_id, task.subject, self.owner, outcome,
                                   epoch=task.lease_epoch)  # fmt: skip
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
                if self.stopping:
                    raise
                self.outage.lost("recorded an outcome", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if landed is None:
                await self.refused("finish", task)
            else:
                metrics.finished(landed)
            return

    async def unstorable(self, task: Task, ref: str) -> None:
        """The outcome could not be stored: fail the task with a stored error rather than leave it working."""
        failure = Outcome.failure(
            FailureReason.UNSTORABLE, f"the tool finished but its result could not be stored (reference {ref})"
        )
        request = FinishRequest.of(task.tenant_id, task.task_id, task.subject, self.owner, failure,
                                   epoch=task.lease_epoch)  # fmt: skip
        try:
            if (landed := await self._finishes.submit(request)) is not None:
                metrics.finished(landed)
        except Exception as exc:  # the lease lapses (no longer renewed) and the reaper fails the task
            log.warning("could not record failure of task %s: %s", task.task_id[:8], exc)

    async def hand_back(self, back: HandBack) -> bool:
        """Re-queue what may run again, fail the rest (the reaper's rule, handback.py), under each
        run's fencing token. False when the database did not answer."""
        try:  # a task whose run left a note (ToolContext.remember) goes back: its tool decides from it
            noted = await self.store.noted([key_of(t) for t in back.tasks if t.rerunnable is not True])
        except Exception as exc:  # the hand-back below meets the same outage; the reaper decides then
            log.warning("could not read the notes of %d task(s): %s", len(back.tasks), exc)
            return False
        requests: list[HandBackRequest] = [
            hand_back(tenant_id=t.tenant_id, task_id=t.task_id, subject=t.subject, tool=t.tool, owner=self.owner,
                      epoch=t.lease_epoch, why=back.why, rerunnable=t.rerunnable is True or key_of(t) in noted,
                      never_started=key_of(t) in back.never_started)
            for t in back.tasks
        ]  # fmt: skip
        by_key = {key_of(t): t for t in back.tasks}
        ordered = sorted(requests, key=lambda r: r.order)
        try:
            moved = await self.store.hand_back(ordered)
        except Exception as exc:  # the reaper takes them over once their leases run out
            log.warning("could not hand back %d task(s): %s", len(requests), exc)
            return False
        count_handed_back(moved)
        for request, task in zip(ordered, moved, strict=True):
            if task is None:
                await self.refused("hand_back", by_key[(request.tenant_id, request.task_id)])
        return True

    async def refused(self, op: str, task: Task) -> None:
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
