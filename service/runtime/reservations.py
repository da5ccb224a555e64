"""The ledger's creates straight to a slot of this process: a slot promised to a create before
it is sent (``reserve``), then the task it wrote run here (``adopted``), or looked up when the
answer was lost (``answer_lost``); and a call that held a slot while it ran inside its request
becoming its task (``converting``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.domain.task import Task
from service.runtime.commands import Command, HandBack, LookUp, Reservation, Run, TaskKey, key_of, never_started
from service.runtime.slots import Slots


class Reservations:
    """Part of ``Ledger``: the events of creates made here."""

    if TYPE_CHECKING:
        slots: Slots
        runs: dict[TaskKey, Run]
        stopping: bool
        draining: bool
        row_sent: float

        @property
        def free(self) -> int: ...

        def at_share(self, tenant_id: str) -> bool: ...

        def row_stale(self, now: float) -> bool: ...

        def _slot_freed(self) -> None: ...

        def _start(
            self, task: Task, *, leased_at: float, covered_since: float, now: float, tool_started: bool = False
        ) -> list[Command]: ...

    def reserve(self, tenant_id: str, now: float, *, running: bool = False, inline: bool = False) -> Reservation | None:
        """A free slot for a task of ``tenant_id`` this process is about to create, or None (no
        free slot, the tenant holds its share, or no lease could be taken now). ``running``: the
        call already runs here (it began inside its request), so it takes a slot even when none
        is free rather than stop. ``inline``: for a call about to run inside its request, which
        may become a task: held within the tenant's share, even when no slot is free (as a call
        running there always could). The creator settles it with ``adopted`` or ``answer_lost``."""
        if self.stopping or self.draining or self.row_stale(now):
            return None
        if not running and ((self.free <= 0 and not inline) or self.at_share(tenant_id)):
            return None
        self.slots.reserved.add(tenant_id, 1)
        return Reservation(tenant_id, now, self.row_sent, running)

    def converting(self, reservation: Reservation, now: float) -> bool:
        """A call that held ``reservation`` while it ran inside its request becomes its task now:
        the slot is the task's, its lease counted from now (False: none may be taken now)."""
        if self.stopping or self.draining or self.row_stale(now):
            return False
        reservation.at, reservation.row_sent, reservation.running = now, self.row_sent, True
        return True

    def _unreserve(self, reservation: Reservation) -> None:
        assert not reservation.settled, "a reservation is settled once"
        reservation.settled = True
        tenant = reservation.tenant_id
        self.slots.reserved.add(tenant, -1)

    def adopted(self, reservation: Reservation, task: Task | None, now: float) -> list[Command]:
        """The create under ``reservation`` was answered: ``task``, leased to us, or None (a cap
        refused it and nothing was written)."""
        self._unreserve(reservation)
        if task is None or key_of(task) in self.runs:  # nothing to run (or it runs here already)
            self._slot_freed()
            return []
        if self.stopping:  # too late to run it here: back to the queue or failed, by the rule
            why = "re-queued: the runner was shut down" if reservation.running else (
                "re-queued: the runner was shut down before it started")  # fmt: skip
            return [HandBack((task,), why, never_started(task, not reservation.running))]
        covered = min(reservation.at, reservation.row_sent)
        return self._start(task, leased_at=reservation.at, covered_since=covered, now=now,
                           tool_started=reservation.running)  # fmt: skip

    def answer_lost(self, reservation: Reservation, task_id: str) -> list[Command]:
        """The create under ``reservation`` failed without an answer: its row may exist, leased
        to us. The slot stays reserved until the look-up settles it (``adopted``)."""
        return [LookUp(reservation, task_id)]
