"""service.domain.eager: a coroutine's first step without a task, the rest as its task would run it."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from service.concurrency import eager

where: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="caller")


async def test_a_coroutine_that_ends_in_its_first_step_gets_no_task() -> None:
    before = len(asyncio.all_tasks())

    async def at_once() -> str:
        where.set("coroutine")
        return "done"

    job = eager.start(at_once())
    assert job.done()
    assert job.result() == "done"
    assert not isinstance(job, asyncio.Task)
    assert len(asyncio.all_tasks()) == before
    assert where.get() == "caller", "what the coroutine set stays in its own context"


async def test_its_exception_and_its_own_cancellation_end_the_future_the_same_way() -> None:
    async def fails() -> None:
        raise ValueError("no")

    async def cancels_itself() -> None:
        raise asyncio.CancelledError

    failed = eager.start(fails())
    assert failed.done()
    assert isinstance(failed.exception(), ValueError)
    assert eager.start(cancels_itself()).cancelled()


async def test_a_waiting_coroutine_goes_on_in_a_task_with_its_context() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[int] = loop.create_future()
    seen: list[object] = []

    async def waits() -> int:
        where.set("coroutine")
        value = await gate
        seen.append(where.get())
        await asyncio.sleep(0)  # a bare yield: one turn of the loop
        return value + 1

    job = eager.start(waits(), name="waiter")
    assert isinstance(job, asyncio.Task)
    assert not job.done()
    assert job.get_name() == "waiter"
    assert where.get() == "caller"
    gate.set_result(41)
    assert await job == 42
    assert seen == ["coroutine"]


async def test_the_awaited_futures_exception_reaches_the_coroutine() -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def waits() -> str:
        try:
            await gate
        except KeyError as exc:
            return f"caught {exc.args[0]}"
        return "not reached"

    job = eager.start(waits())
    gate.set_exception(KeyError("k"))
    assert await job == "caught k"


async def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    cleaned: list[str] = []

    async def waits() -> None:
        try:
            await gate
        finally:
            cleaned.append("finally")

    job = eager.start(waits())
    await asyncio.sleep(0)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert job.cancelled()
    assert gate.cancelled()
    assert cleaned == ["finally"]


async def test_a_cancel_between_wake_up_and_step_still_reaches_the_coroutine() -> None:
    """The future is done when the cancel comes (the task is about to step): a task would throw the
    cancellation into the coroutine rather than hand it the result."""
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    got: list[str] = []

    async def waits() -> None:
        try:
            await gate
            got.append("result")
        except asyncio.CancelledError:
            got.append("cancelled")
            raise

    job = eager.start(waits())
    await asyncio.sleep(0)
    gate.set_result(1)  # wakes the task: its step is scheduled
    job.cancel()  # before that step runs
    with pytest.raises(asyncio.CancelledError):
        await job
    assert got == ["cancelled"]


async def test_a_coroutine_may_catch_its_cancellation_and_answer() -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def waits() -> str:
        try:
            await gate
        except asyncio.CancelledError:
            return "stopped cleanly"
        return "not reached"

    job = eager.start(waits())
    await asyncio.sleep(0)
    job.cancel()
    assert await job == "stopped cleanly"


async def test_a_bad_yield_is_refused_inside_the_coroutine() -> None:
    class Odd:
        def __await__(self):  # type: ignore[no-untyped-def]
            return (yield "not a future")

    async def waits() -> str:
        try:
            await Odd()
        except RuntimeError as exc:
            return str(exc)
        return "not reached"

    assert "bad yield" in await eager.start(waits())


async def test_started_from_a_callback_it_runs_in_a_task_where_a_timeout_works() -> None:
    """A first step taken in a callback's turn would have no task: asyncio.timeout (which asyncpg's
    connect uses when a pool grows) then raised "Timeout should be used inside a task" in a run
    adopted from a create's answer."""

    async def times_out_first() -> str:
        async with asyncio.timeout(5):
            return "in time"

    started: list[asyncio.Future[str]] = []
    asyncio.get_running_loop().call_soon(lambda: started.append(eager.start(times_out_first())))
    await asyncio.sleep(0)
    assert await started[0] == "in time"
