"""Giving a task back when its run cannot go on: the one rule for the reaper and a stopping runner."""

from __future__ import annotations

from service.store.requests import ReleaseRequest
from service.tools.execute import runner_stopped
from service.tools.registry import Registry

# A task whose runs keep being lost is failed after this many attempts, rerunnable or not.
MAX_ATTEMPTS = 3


def hand_back(
    registry: Registry, *, tenant_id: str, task_id: str, subject: str, tool: str, owner: str, epoch: int,
    why: str, rerunnable: bool | None, never_started: bool = False, only_if_lapsed: bool = False,
) -> ReleaseRequest:  # fmt: skip
    """Run it again if its tool is safe to re-run (or it never started), else fail it; only while
    (owner, epoch) still holds its lease, and for the reaper (``only_if_lapsed``) once that ran out.

    ``rerunnable`` is the task's own record, written at create by the process that accepted it: the
    one giving it back (a reaper, perhaps without the tool's pack) decides by it, not by its own
    registry. Only a task of a release that did not record it (None) falls back to the registry,
    and a tool unknown here then counts as not rerunnable (never run twice by guesswork)."""
    if rerunnable is None:
        spec = registry.tools.get(tool)
        rerunnable = spec is not None and spec.rerunnable
    return ReleaseRequest(
        tenant_id=tenant_id,
        task_id=task_id,
        owner=owner,
        rerunnable=never_started or rerunnable,
        max_attempts=MAX_ATTEMPTS,
        requeue_message=why,
        failure=runner_stopped(tool).payload,
        subject=subject,
        epoch=epoch,
        only_if_lapsed=only_if_lapsed,
    )
