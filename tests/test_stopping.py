"""Background loops stop for good (service/domain/stopping.py)."""

from __future__ import annotations

import asyncio

from service.concurrency.stopping import cancel_and_wait


async def test_a_loop_that_swallows_a_cancellation_is_cancelled_again_until_it_stops() -> None:
    """asyncio.wait_for in Python 3.11 can lose a cancellation that arrives as its inner await
    completes; the loop around it then runs on. Shown here by a loop that swallows the first
    cancellation outright: a single cancel() and await would wait for it forever."""
    swallowed = 0

    async def loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed == 0:
                    swallowed += 1
                    continue  # as wait_for returning its result instead of raising
                raise

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.02)
    async with asyncio.timeout(5):
        await cancel_and_wait(task, retry_s=0.05)
    assert task.cancelled()
    assert swallowed == 1


async def test_a_loop_that_failed_is_collected_not_raised() -> None:
    async def broken() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert isinstance(task.exception(), RuntimeError)
