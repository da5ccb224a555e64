"""A coroutine's first step taken at once, without a task of its own (what Python 3.12's eager
task factory does; this service runs on 3.11).

Most plain tool calls end within their first step (``echo``, an answer from memory): a task for
one costs its creation, a turn of the event loop for its step and one more for each done callback,
more than the call itself. ``start`` runs the first step in the caller's turn, in a context of its
own as a task would; only a coroutine still waiting after it gets a task, which takes over where it
stopped: the coroutine sees the same results, exceptions and cancellations as under a task of its
own from the start.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def start(coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Future[T]:
    """``coro``'s outcome: a future already done when its first step ended it, else the task
    running the rest (``name`` names it). Cancel either to cancel the coroutine."""
    loop = asyncio.get_running_loop()
    if asyncio.current_task(loop) is None:
        # Called from a callback (a create's answer settling a slot): a first step taken here would
        # run with no task at all, and whatever needs one (asyncio.timeout, as asyncpg's connect
        # uses when a pool grows) would fail.
        return loop.create_task(coro, name=name)
    context = contextvars.copy_context()  # what the coroutine sets stays its own, as under a task
    try:
        waiting = context.run(coro.send, None)
    except StopIteration as done:
        finished: asyncio.Future[T] = loop.create_future()
        finished.set_result(done.value)
        return finished
    except asyncio.CancelledError:
        cancelled: asyncio.Future[T] = loop.create_future()
        cancelled.cancel()
        return cancelled
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        failed: asyncio.Future[T] = loop.create_future()
        failed.set_exception(exc)
        return failed
    return loop.create_task(_rest(coro, waiting), name=name, context=context)


async def _rest(coro: Coroutine[Any, Any, T], waiting: Any) -> T:
    """Drive ``coro`` on from a step that left it waiting on ``waiting`` (what it yielded to its
    would-be task: a future, or None for one turn of the loop), as ``asyncio.Task`` would."""
    while True:
        throw: BaseException | None = None
        try:
            if waiting is None:
                await asyncio.sleep(0)
            elif getattr(waiting, "_asyncio_future_blocking", None) is not None:
                waiting._asyncio_future_blocking = False  # as Task.__step does before it waits
                await waiting
            else:
                throw = RuntimeError(f"Task got bad yield: {waiting!r}")
        except BaseException as exc:
            # The future's own exception the coroutine reads from the future when it resumes;
            # anything else (this task cancelled, with the future or between its wake-up and its
            # step) goes into the coroutine where it waits.
            if not _failed_itself(waiting, exc):
                throw = exc
        try:
            waiting = coro.send(None) if throw is None else coro.throw(throw)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _failed_itself(future: Any, exc: BaseException) -> bool:
    """Did awaiting ``future`` raise ``exc`` because the future ended with it (not a cancellation)?"""
    return (
        future is not None
        and not isinstance(exc, asyncio.CancelledError)
        and future.done()
        and not future.cancelled()
        and future.exception() is exc
    )
