"""Plain calls and the requestor's cap: a plain (non-task) call holds one of its requestor's
active-task slots while it runs (issue 14 §7), counted with its tasks.

The requestor's active tasks are read from the database at most every PLAIN_CAP_RECOUNT_S
(docs/decisions.md, "Plain calls and the cap"); a refusal is always decided on a fresh count.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable

from service.domain.errors import CapacityExceeded
from service.domain.principal import Caller, Principal
from service.store.tasks import TaskStore

PLAIN_CAP_RECOUNT_S = 1.0
# Remembered counts kept at most (oldest dropped first): one entry per requestor seen recently.
PLAIN_CAP_REMEMBERED = 10_000

Release = Callable[[], None]
Refuse = Callable[[Caller, str, int], Awaitable[CapacityExceeded]]


class PlainSlots:
    def __init__(self, store: TaskStore, max_per_requestor: int, refuse: Refuse) -> None:
        """``refuse(caller, tool, plain)``: the audited CapacityExceeded of a refused call, counting
        ``plain`` calls of the requestor running here."""
        self.store = store
        self.max_per_requestor = max_per_requestor
        self._refuse = refuse
        # Plain calls running in this process, per requestor.
        self.running: Counter[tuple[str, str]] = Counter()
        # Per requestor: its active tasks as last read for a plain call, and when (monotonic).
        # Forgotten when this process creates one of its tasks, so only other replicas' creates
        # of the last PLAIN_CAP_RECOUNT_S can go unseen by an admission.
        self._task_counts: dict[tuple[str, str], tuple[int, float]] = {}

    def take(self, caller: Caller) -> Release | None:
        """``hold`` without I/O: the slot, taken, when the requestor's remembered count admits it;
        None when only a fresh count can tell (then ``hold``)."""
        key = caller.principal.owner_key
        held = self.running.get(key, 0) + 1
        tasks = self._remembered_tasks(key)
        if tasks is None or tasks + held > self.max_per_requestor:
            return None
        self.running[key] = held
        return _Slot(self, key)

    async def hold(self, caller: Caller, tool: str) -> Release:
        """Take one of the requestor's active-task slots (its tasks and the plain calls it runs here
        count together); returns how to give it back. Beyond the cap, the same refusal as a
        create: CapacityExceeded, audited."""
        if (slot := self.take(caller)) is not None:
            return slot
        key = caller.principal.owner_key
        self.running[key] += 1  # taken before the count is read: concurrent calls cannot overshoot
        limit = self.max_per_requestor
        try:
            over = self.running[key] > limit
            if not over:
                tasks = self._remembered_tasks(key)
                if tasks is None or tasks + self.running[key] > limit:  # refused only on a fresh count
                    tasks = await self._count_tasks(caller.principal)
                over = tasks + self.running[key] > limit
            if over:
                raise await self._refuse(caller, tool, self.running[key] - 1)
        except BaseException:
            self.release(key)
            raise
        return _Slot(self, key)

    def release(self, key: tuple[str, str]) -> None:
        self.running[key] -= 1
        if self.running[key] <= 0:
            del self.running[key]

    def forget(self, key: tuple[str, str]) -> None:
        """The requestor's task count changed here (a create): read it afresh next time."""
        self._task_counts.pop(key, None)

    def _remembered_tasks(self, key: tuple[str, str]) -> int | None:
        """The requestor's active tasks as read for a plain call within PLAIN_CAP_RECOUNT_S, if any."""
        remembered = self._task_counts.get(key)
        if remembered is None or time.monotonic() - remembered[1] > PLAIN_CAP_RECOUNT_S:
            return None
        return remembered[0]

    async def _count_tasks(self, principal: Principal) -> int:
        """The requestor's active tasks from the counters, remembered for the next plain calls."""
        count = await self.store.active_for(principal)
        counts = self._task_counts
        counts.pop(principal.owner_key, None)  # re-inserted last: the dict stays in order of reading
        counts[principal.owner_key] = (count, time.monotonic())
        if len(counts) > PLAIN_CAP_REMEMBERED:
            del counts[next(iter(counts))]
        return count


class _Slot:
    """How a plain call gives its requestor's slot back: once, however often it is called."""

    __slots__ = ("_key", "_slots")

    def __init__(self, slots: PlainSlots, key: tuple[str, str]) -> None:
        self._slots: PlainSlots | None = slots
        self._key = key

    def __call__(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.release(self._key)
