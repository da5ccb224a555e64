"""Following an HTTP upstream that speaks only 2026-07-28 (it refused our 2025-11-25 ``initialize``).

That wire has no session to carry ``notifications/tools/list_changed``: a ``subscriptions/listen``
asks for them (``toolsListChanged``) and is opened again when it ends. The tools are also listed
again every ``refresh_s`` (a change made while no listen was open is seen then), and
``server/discover`` is the ping.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import httpx

from service.upstream.auth import UpstreamAuthError
from service.upstream.modern import BadAnswer, Modern, ModernError, SilentUpstream, discovered

LISTEN_IDLE_S: Final = 300.0  # a listen that carried nothing this long is opened again
LISTEN_BACKOFF_S: Final = (1.0, 60.0)  # before opening it again: from the first, doubling to the second
LISTEN_SETTLED_S: Final = 60.0  # a listen open this long ended normally: the next one opens after the first delay


async def watch(
    modern: Modern, refresh: asyncio.Event, relist: Callable[[], Awaitable[None]], *, ping_s: float,
    ping_timeout_s: float, refresh_s: float,
) -> None:  # fmt: skip
    """Until a ping or a listing fails (raised): ``relist`` when a listen says the tools changed
    (``refresh`` set) or every ``refresh_s``; ``server/discover`` every ``ping_s`` otherwise."""
    loop = asyncio.get_running_loop()
    listed = loop.time()
    listener = asyncio.create_task(listen(modern, refresh), name="upstream-listen")
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(refresh.wait(), ping_s)
            if refresh.is_set() or loop.time() - listed >= refresh_s:
                refresh.clear()
                await relist()
                listed = loop.time()
            else:
                await discovered(modern, timeout_s=ping_timeout_s)
    finally:
        listener.cancel()
        await asyncio.wait({listener})


async def listen(modern: Modern, refresh: asyncio.Event) -> None:
    """``subscriptions/listen`` for ``toolsListChanged``, each setting ``refresh``; opened again
    when it ends, after a delay that grows while it keeps failing. An upstream that answers the
    method with an error has none: then the periodic listing alone."""

    async def noted(message: dict[str, Any]) -> None:
        if message.get("method") == "notifications/tools/list_changed":
            refresh.set()

    first, most = LISTEN_BACKOFF_S
    delay = first
    while True:
        opened = time.monotonic()
        try:
            await modern.request("subscriptions/listen", {"notifications": {"toolsListChanged": True}},
                                 idle_s=LISTEN_IDLE_S, deadline=opened + 86_400, on_notification=noted)  # fmt: skip
        except ModernError:
            return
        except (BadAnswer, SilentUpstream, httpx.HTTPError, UpstreamAuthError):
            pass
        if time.monotonic() - opened >= LISTEN_SETTLED_S:
            delay = first
        await asyncio.sleep(delay)
        delay = min(most, delay * 2)
