"""Giving a task back when its run cannot go on: the one rule for the reaper and a stopping runner."""

from __future__ import annotations

from collections.abc import Iterable

from service.domain.task import Task, TaskStatus
from service.observability import metrics
from service.store.requests import HandBackRequest
from service.tools.execute import runner_stopped

# A task whose runs keep being lost is failed after this many attempts, rerunnable or not.
MAX_ATTEMPTS = 3


def hand_back(
    *, tenant_id: str, task_id: str, subject: str, tool: str, owner: str, epoch: int, why: str, rerunnable: bool,
    never_started: bool = False, only_if_lapsed: bool = False,
) -> HandBackRequest:  # fmt: skip
    """Run it again if its tool is safe to re-run (or it never started), else fail it; only while
    (owner, epoch) still holds its lease, and for the reaper (``only_if_lapsed``) once it lapsed.

    ``rerunnable`` is the task's own record, written at create by the process that accepted it:
    the one giving it back (a reaper, perhaps without the tool's pack) decides by it, not by its
    own registry."""
    return HandBackRequest(
        tenant_id=tenant_id,
        task_id=task_id,
        owner=owner,
        rerunnable=never_started or rerunnable,
        max_attempts=MAX_ATTEMPTS,
        requeue_message=why,
        failure=runner_stopped(tool).payload,
        epoch=epoch,
        subject=subject,
        only_if_lapsed=only_if_lapsed,
    )


def count_handed_back(moved: Iterable[Task | None]) -> int:
    """Count what a hand-back changed (re-queued, or failed and so finished); how many it moved."""
    n = 0
    for task in moved:
        if task is None:
            continue
        n += 1
        requeued = task.status is TaskStatus.WORKING
        metrics.lease_losses.labels("requeued" if requeued else "failed").inc()
        if not requeued:
            metrics.finished(task)
    return n
