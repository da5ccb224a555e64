"""Stopping background loops for good.

``asyncio.wait_for`` in Python 3.11 can swallow a cancellation that arrives just as the awaited
thing completes: the loop around it then runs on, and whoever awaits the cancelled loop waits
forever (a test server's teardown hung on it now and then). So a loop is cancelled again until it
is done.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*loops: asyncio.Task[Any], retry_s: float = 0.2) -> None:
    """Cancel each loop and wait until all are done, cancelling again those still running."""
    pending = {loop for loop in loops if not loop.done()}
    while pending:
        for loop in pending:
            loop.cancel()
        _done, pending = await asyncio.wait(pending, timeout=retry_s)
    for loop in loops:  # collected, so none is reported as "exception never retrieved"
        if not loop.cancelled():
            loop.exception()
