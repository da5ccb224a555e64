"""Group commit: the requests that arrive while a statement is in flight go together in the next one.

At most one batch statement per batcher is in flight. A request that finds none starts one at
once (no added wait when the service is idle); requests arriving meanwhile queue up and go out
together as soon as it returns, so under load one round trip, one statement and one durable commit
serve many requests, and each is still answered only after its commit. Items are sorted before
they are sent, so every batch takes its row locks in one global order (see migration 0005).

One tenant's items cannot hold another's up (docs/decisions.md, "Isolation inside a batch"): an
item carrying more than ``LARGE_ITEM_BYTES`` goes through a second lane with a statement of its
own, so small items never share a statement with a large one nor wait for one; in each lane the
next batch takes the queued tenants in turns (one item of each, then a second of each, ...) and
stops at ``MAX_ITEMS`` items or ``MAX_BATCH_BYTES`` (a larger item goes alone), so an item goes out
with the next statement of its lane however much another tenant has queued.

A batch that PostgreSQL refuses as a whole (for example a deadlock, or one request's text it
cannot store) rolled back, so it is retried one item at a time (each a batch of one, through the
same statement) and each request gets its own answer or error. Any other failure leaves the batch's outcome unknown: every request in it gets
the error, and nothing is replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

import asyncpg

from service.domain.errors import Unavailable
from service.observability import metrics, tracing

log = logging.getLogger(__name__)


class Batched(Protocol):
    @property
    def order(self) -> tuple[str, ...]:
        """The lock order; its first element is the tenant."""
        ...

    @property
    def size_bytes(self) -> int: ...


T = TypeVar("T", bound=Batched)
R = TypeVar("R")

MAX_ITEMS = 64
# Before a batch goes out, the loop turns this many times at most while each turn brings more
# items (the requests already under way join it): bigger batches under load, one turn when idle.
GATHER_TURNS = 8
LARGE_ITEM_BYTES = 64 * 1024
MAX_BATCH_BYTES = 1024 * 1024
SMALL, LARGE = 0, 1  # the lanes


class Batcher(Generic[T, R]):
    """Coalesces calls of ``run_many``; an item is answered alone (a batch of one) when its batch failed."""

    def __init__(
        self, run_many: Callable[[list[T]], Awaitable[list[R]]], *, name: str, max_items: int = MAX_ITEMS,
        hold: Callable[[], contextlib.AbstractAsyncContextManager[None]] | None = None,
    ) -> None:  # fmt: skip
        """``hold``: entered around each drain (a burst of batches), e.g. ``Database.holding`` so the
        batches of a burst share one pooled connection."""
        self._hold = hold
        self._sizes = metrics.db_batch_items.labels(name)
        self._fallbacks = metrics.db_batch_fallbacks.labels(name)
        self._run_many = run_many
        self._max_items = max_items
        self._name = name
        # Per lane: the queue (item, future, size in bytes) in arrival order, and its drainer.
        self._queues: tuple[list[tuple[T, asyncio.Future[R], int]], ...] = ([], [])
        self._drainers: list[asyncio.Task[None] | None] = [None, None]
        # Tracing on: the span context of each queued item's request, for its batch's span's links.
        self._carried: dict[asyncio.Future[R], object] = {}

    def enqueue(self, item: T) -> asyncio.Future[R]:
        """The future of ``item``'s result. Cancelling a wait on it does not withdraw the item:
        await it through ``asyncio.shield`` to learn what became of an item whose wait was cancelled."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        size = item.size_bytes
        lane = LARGE if size > LARGE_ITEM_BYTES else SMALL
        self._queues[lane].append((item, future, size))
        if tracing.enabled() and (carried := tracing.capture()) is not None:  # a sampled request
            self._carried[future] = carried
        if self._drainers[lane] is None:
            self._drainers[lane] = asyncio.create_task(self._drain(lane), name=f"batch-drain-{self._name}")
        return future

    async def submit(self, item: T) -> R:
        return await self.enqueue(item)

    async def _drain(self, lane: int) -> None:
        queue = self._queues[lane]
        try:
            # Items queued while the hold is given back (an await) find this drainer still set:
            # the outer loop takes them. No await between its last look and the finally below.
            while queue:
                async with self._hold() if self._hold is not None else contextlib.nullcontext():
                    while queue:
                        await self._gather(queue)
                        await self._run(_take(queue, self._max_items))
        finally:
            self._drainers[lane] = None
            # Cancelled (shutdown): nobody who queued meanwhile is left waiting.
            for _item, future, _size in queue:
                _settle(future, exc=Unavailable("the service is shutting down; retry"))
                self._carried.pop(future, None)
            queue.clear()

    async def _gather(self, queue: list[tuple[T, asyncio.Future[R], int]]) -> None:
        """Let the requests already under way join the next batch: the loop turns while each turn
        brings more items, up to GATHER_TURNS turns or a full batch. Idle, that is one turn; under
        load a statement then serves more requests (its cost is mostly per statement)."""
        seen = len(queue)
        for _ in range(GATHER_TURNS):
            if seen >= self._max_items:
                return
            await asyncio.sleep(0)
            if len(queue) == seen:
                return
            seen = len(queue)

    async def _run(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        carried = [self._carried.pop(future, None) for _item, future in batch] if self._carried else []
        # A request whose waiter is gone (and did not shield its future) is not sent: nobody would
        # get its answer, and a retrieve would be audited as handed out.
        batch = [entry for entry in batch if not entry[1].done()]
        if not batch:
            return
        batch.sort(key=lambda entry: entry[0].order)
        self._sizes.observe(len(batch))
        try:
            with tracing.batch_span(f"batch {self._name}", carried, {"db.system.name": "postgresql",
                                    "db.operation.batch.size": len(batch)}):  # fmt: skip
                await self._answer(batch)
        finally:
            # Whatever went wrong (cancelled at shutdown, a bug), no waiter is left hanging.
            for _item, future in batch:
                _settle(future, exc=Unavailable("the service is shutting down; retry"))

    async def _answer(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._run_many([item for item, _future in batch])
        except Exception as exc:
            if len(batch) == 1 or not _rolled_back(exc):
                # Unavailable, or a failure after the statement may have committed: its outcome is
                # unknown, so nothing is replayed (a replayed create could exist twice).
                for _item, future in batch:
                    _settle(future, exc=exc)
                return
            self._fallbacks.inc()
            log.warning("a batch of %d failed (%s); answering its items one by one", len(batch), type(exc).__name__)
            for item, future in batch:
                if future.done():  # its waiter went away meanwhile: not sent, as above
                    continue
                try:
                    (alone,) = await self._run_many([item])
                except Exception as one_exc:
                    _settle(future, exc=one_exc)
                else:
                    _settle(future, result=alone)
            return
        if len(results) != len(batch):  # a bug: nobody gets an answer that may be someone else's
            failure = RuntimeError(f"a batch of {len(batch)} came back with {len(results)} results")
            for _item, future in batch:
                _settle(future, exc=failure)
            return
        for (_item, future), result in zip(batch, results, strict=True):
            _settle(future, result=result)


def _take(queue: list[tuple[T, asyncio.Future[R], int]], max_items: int) -> list[tuple[T, asyncio.Future[R]]]:
    """The next batch, taken out of ``queue``: the queued tenants in turns, in order of arrival, up
    to ``max_items`` items and ``MAX_BATCH_BYTES`` (the first item always goes). The rest stay
    queued in arrival order."""
    by_tenant: dict[str, list[int]] = {}
    for index, (item, _future, _size) in enumerate(queue):
        by_tenant.setdefault(item.order[0], []).append(index)
    turns: list[int] = []
    rank = 0
    while len(turns) < min(max_items, len(queue)):
        turns.extend(indexes[rank] for indexes in by_tenant.values() if rank < len(indexes))
        rank += 1
    taken: list[int] = []
    size = 0
    for index in turns[:max_items]:
        if taken and size + queue[index][2] > MAX_BATCH_BYTES:
            break
        taken.append(index)
        size += queue[index][2]
    batch = [(queue[index][0], queue[index][1]) for index in taken]
    chosen = set(taken)
    queue[:] = [entry for index, entry in enumerate(queue) if index not in chosen]
    return batch


# SQLSTATE classes that say the server or the connection went away, not that the statement was
# refused: connection exception, insufficient resources, operator intervention, system error, internal.
_OUTAGE_CLASSES = frozenset({"08", "53", "57", "58", "XX"})


def _rolled_back(exc: BaseException) -> bool:
    """Did PostgreSQL refuse the statement, so nothing of it was committed? An error it raised
    (possibly translated to a domain error by the database layer), but not an outage: a server
    shut down after committing raises one too."""
    if isinstance(exc, Unavailable):
        return False
    cause = exc if isinstance(exc, asyncpg.PostgresError) else exc.__cause__
    if not isinstance(cause, asyncpg.PostgresError):
        return False
    return str(cause.sqlstate or "")[:2] not in _OUTAGE_CLASSES


def _settle(future: asyncio.Future[R], *, result: R | None = None, exc: BaseException | None = None) -> None:
    if future.done():  # its waiter was cancelled and took the future with it
        return
    if exc is not None:
        future.set_exception(exc)
        # Marked retrieved at once: an outcome nobody awaits any more (its waiter was cancelled
        # under a shield) is not an error to log, and a waiter still gets it. (A done callback
        # per future did this for every item: a turn of the event loop each.)
        future.exception()
    else:
        future.set_result(result)  # type: ignore[arg-type]
