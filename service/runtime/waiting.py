"""The ledger's runs that wait for an answer (issue 42 §3: waiting is not running).

A run whose tool waits for its client's answer gives its slot back to the process, so a tenant
that leaves questions unanswered holds no slot another tenant's task could use. What waits that
way is bounded: a share per tenant and ``concurrency`` in all (``Slots.may_wait``); beyond it a
waiting run keeps its slot. When the answer comes the run takes a slot again under the same
fairness as any start: at once when one is free and its tenant is below its share, else in turn
as slots free, before any claim (``resumers``; the runner wakes each one given a slot,
``take_resumed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.runtime.commands import Run
from service.runtime.slots import Slots


class WaitingRuns:
    """Part of ``Ledger``: what it holds for runs that wait, and the events about them."""

    resumers: list[Run]  # answered, waiting for a slot, in order
    resumed: list[Run]  # given a slot since the runner last looked

    if TYPE_CHECKING:
        slots: Slots

        @property
        def free(self) -> int: ...

        def at_share(self, tenant_id: str) -> bool: ...

        def _give_slot(self, run: Run) -> None: ...

    def run_waiting(self, run: Run) -> None:
        """The run's tool waits for an answer: its slot goes back to the process while its tenant's
        waiting runs are within their allowance; beyond it the run keeps its slot."""
        tenant = run.task.tenant_id
        if run.holds_slot and not run.tool_done and self.slots.may_wait(tenant):
            run.waiting = True
            self.slots.waiting.add(tenant, 1)
            self._give_slot(run)

    def run_resuming(self, run: Run) -> bool:
        """The answer came: the run takes a slot again now (True), or, with none free or its tenant
        at its share, waits in turn for the next (False; ``take_resumed`` names it once given)."""
        if not run.waiting or run in self.resumers:
            return not run.waiting
        if self.free > 0 and not self.at_share(run.task.tenant_id):
            self._take_slot_back(run)
            return True
        self.resumers.append(run)
        return False

    def take_resumed(self) -> list[Run]:
        resumed, self.resumed = self.resumed, []
        return resumed

    def _grant_resumers(self) -> None:
        """A slot freed: answered runs get it first, the first whose tenant is below its share."""
        while self.resumers and self.free > 0:
            run = next((r for r in self.resumers if not self.at_share(r.task.tenant_id)), None)
            if run is None:
                return
            self.resumers.remove(run)
            self._take_slot_back(run)
            self.resumed.append(run)

    def _take_slot_back(self, run: Run) -> None:
        tenant = run.task.tenant_id
        run.waiting, run.holds_slot = False, True
        self.slots.waiting.add(tenant, -1)
        self.slots.running.add(tenant, 1)

    def _wait_ended(self, run: Run) -> None:
        """The run ended while it waited (cancelled, fenced, stopped): it waits no more."""
        if run.waiting:
            run.waiting = False
            self.slots.waiting.add(run.task.tenant_id, -1)
            if run in self.resumers:
                self.resumers.remove(run)
