"""Group commit: the requests that arrive while a statement is in flight go together in the next one.

At most one batch statement per batcher is in flight. A request that finds none starts one at
once (no added wait when the service is idle); requests arriving meanwhile queue up and go out
together as soon as it returns, so under load one round trip, one statement and one durable commit
serve many requests, and each is still answered only after its commit. Items are sorted before
they are sent, so every batch takes its row locks in one global order (see migration 0005).

A batch that PostgreSQL refuses as a whole (for example a deadlock, or one request's text it
cannot store) rolled back, so it is retried one item at a time (each a batch of one, through the
same statement) and each request gets its own answer or error. Any other failure leaves the batch's outcome unknown: every request in it gets
the error, and nothing is replayed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

import asyncpg

from service.domain.errors import Unavailable
from service.observability import metrics

log = logging.getLogger(__name__)


class Ordered(Protocol):
    @property
    def order(self) -> tuple[str, ...]: ...


T = TypeVar("T", bound=Ordered)
R = TypeVar("R")

MAX_ITEMS = 64


class Batcher(Generic[T, R]):
    """Coalesces calls of ``run_many``; an item is answered alone (a batch of one) when its batch failed."""

    def __init__(
        self, run_many: Callable[[list[T]], Awaitable[list[R]]], *, name: str, max_items: int = MAX_ITEMS
    ) -> None:
        self._sizes = metrics.db_batch_items.labels(name)
        self._fallbacks = metrics.db_batch_fallbacks.labels(name)
        self._run_many = run_many
        self._max_items = max_items
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._drainer: asyncio.Task[None] | None = None

    def enqueue(self, item: T) -> asyncio.Future[R]:
        """The future of ``item``'s result. Cancelling a wait on it does not withdraw the item:
        await it through ``asyncio.shield`` to learn what became of an item whose wait was cancelled."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        # An outcome nobody awaits any more (its waiter was cancelled under a shield) is not an error to log.
        future.add_done_callback(_retrieved)
        self._queue.append((item, future))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain(), name="batch-drain")
        return future

    async def submit(self, item: T) -> R:
        return await self.enqueue(item)

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._queue[: self._max_items]
                del self._queue[: self._max_items]
                await self._run(batch)
        finally:
            self._drainer = None
            # Cancelled (shutdown): nobody who queued meanwhile is left waiting.
            for _item, future in self._queue:
                _settle(future, exc=Unavailable("the service is shutting down; retry"))
            self._queue.clear()

    async def _run(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        # A request whose waiter is gone (and did not shield its future) is not sent: nobody would
        # get its answer, and a retrieve would be audited as handed out.
        batch = [entry for entry in batch if not entry[1].done()]
        if not batch:
            return
        batch.sort(key=lambda entry: entry[0].order)
        self._sizes.observe(len(batch))
        try:
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
    else:
        future.set_result(result)  # type: ignore[arg-type]


def _retrieved(future: asyncio.Future[R]) -> None:
    if not future.cancelled():
        future.exception()
