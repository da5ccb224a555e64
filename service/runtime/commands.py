"""What the runner's ledger records (runs, reservations) and the commands it answers with.

A command is what the runner (``runner.py``) must carry out: claim, start or stop a run, hand
tasks back, publish its row afresh, look a task up, re-read a lease. The ledger (``ledger.py``)
decides; these are the words it decides in.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.domain.task import Task
from service.domain.values import frozen

TaskKey = tuple[str, str]
# The most tasks one claim asks for.
CLAIM_BATCH = 16


def key_of(task: Task) -> TaskKey:
    return (task.tenant_id, task.task_id)


@dataclass(slots=True, eq=False)
class Run:
    """One task this runner executes, with what the ledger knows of its lease."""

    task: Task  # its lease_epoch (with the runner's owner name) is the run's fencing token
    # No later than the statement that last made its lease hold for at least a lease.
    renewed_at: float
    # When the task's own lease was last set (claim, create, its renewal).
    task_lease_set_at: float
    tool_started: bool = False  # its tool was called (or its call began inside a request)
    tool_done: bool = False  # the outcome is in hand: nothing left to stop, only its write
    fenced: bool = False  # stopped for want of a renewal: nothing of it is written any more
    holds_slot: bool = True  # its tool runs (or is about to)
    waiting: bool = False  # its tool waits for an answer, its slot given back (``Ledger.run_waiting``)

    @property
    def key(self) -> TaskKey:
        return key_of(self.task)


@dataclass(slots=True, eq=False)
class Reservation:
    """A slot promised to a create of ``tenant_id`` this process is about to make."""

    tenant_id: str
    at: float  # no later than the start of the create's own lease
    row_sent: float  # when the extension of the runner's row that covers it was sent
    running: bool  # the call already runs here (it began inside its request)
    settled: bool = False


@frozen
class Claim:
    """Ask the database for up to ``want`` queued tasks, none taking a tenant past its share
    counting what it ``held`` here when sent; each subject's turns after its ``running`` runs."""

    want: int
    held: dict[str, int]
    running: dict[tuple[str, str], int]
    sent: float
    row_sent: float


@frozen
class Start:
    """Run the task's tool (or, for a call that began inside its request, go on awaiting it)."""

    run: Run


@frozen
class Stop:
    """Cancel the run's tool: its lease is no longer ours (``fenced``: for want of a renewal)."""

    run: Run
    fenced: bool


@frozen
class HandBack:
    """Give tasks back (re-queued or failed, by the hand-back rule) under their fencing tokens.
    ``never_started``: the keys of those whose tool was never called (they go back to the queue
    whatever their tool); ``fenced``: how many are handed back for want of a lease."""

    tasks: tuple[Task, ...]
    why: str
    never_started: frozenset[TaskKey]
    fenced: int = 0


@frozen
class Publish:
    """The runner's row lapsed: publish it afresh (then ``published``), for new work only."""


@frozen
class LookUp:
    """A create under ``reservation`` got no answer: read whether it exists, leased to us."""

    reservation: Reservation
    task_id: str


@frozen
class CheckLease:
    """A cancel or delete was announced for a running task: re-read its row (``lease_checked``)."""

    run: Run


Command = Start | Stop | HandBack | Publish | LookUp | CheckLease


@frozen
class Renewal:
    """A beat to send: extend the runner's row and the own leases of the ``due`` runs."""

    runs: tuple[Run, ...]  # the runs it judges (a run started while it is in flight is not)
    due: tuple[Run, ...]
    sent: float


def never_started(task: Task, never: bool) -> frozenset[TaskKey]:
    return frozenset({key_of(task)}) if never else frozenset()
