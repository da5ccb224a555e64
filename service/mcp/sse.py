"""Server-Sent Events over raw ASGI, with keep-alives and deterministic clean-up on disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import Receive, Send

from service.mcp.jsonrpc import dumps

log = logging.getLogger(__name__)

KEEPALIVE_S = 15.0
# A shutdown's streams end this long before the server's graceful-shutdown timeout would cut them.
STREAM_END_MARGIN_S = 0.5


class StreamsClosing:
    """A shutdown, as open streams see it: ``begun`` when it starts (streams that carry nothing a
    client loses by reconnecting end then: GET streams); ``deadline`` shortly before the server's
    graceful-shutdown timeout (every other stream ends then, properly, rather than have the server
    cancel its request, which it logs as an error with a traceback)."""

    def __init__(self) -> None:
        self.begun = asyncio.Event()
        self.deadline = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    def begin(self, graceful_timeout_s: float) -> None:
        """In the event loop: the shutdown began; streams have until the timeout (less a margin)."""
        if self.begun.is_set():
            return
        self.begun.set()
        delay = max(0.0, graceful_timeout_s - STREAM_END_MARGIN_S)
        self._timer = asyncio.get_running_loop().call_later(delay, self.deadline.set)

    def end_now(self) -> None:
        self.begun.set()
        self.deadline.set()
        if self._timer is not None:
            self._timer.cancel()


async def send_sse(
    send: Send,
    receive: Receive,
    messages: AsyncIterator[dict[str, Any]],
    *,
    headers: dict[str, str] | None = None,
    keepalive_s: float = KEEPALIVE_S,
    abort: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Stream ``messages`` as SSE events until exhausted, aborted, or the client goes away.

    A disconnect is not a cancellation of the underlying work (H-POST-11, T-RES-8): it only ends
    this stream, and ``messages`` is closed so its clean-up (e.g. releasing undelivered
    elicitations) runs at once. ``abort`` ends the stream without a response (C-4, C-9); so does
    ``stop`` (a shutdown: the client retries or reconnects, to another replica).
    """
    raw_headers = [
        (b"content-type", b"text/event-stream"),
        (b"cache-control", b"no-cache, no-transform"),
        (b"x-accel-buffering", b"no"),
    ]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": 200, "headers": raw_headers})

    async def pump() -> None:
        iterator = messages.__aiter__()
        # One pending step survives keep-alives: a timeout must never cancel the generator itself.
        step: asyncio.Future[dict[str, Any]] | None = None
        try:
            while True:
                if step is None:
                    step = asyncio.ensure_future(anext(iterator))
                done, _ = await asyncio.wait({step}, timeout=keepalive_s)
                if not done:
                    await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})
                    continue
                finished, step = step, None
                try:
                    message = finished.result()
                except StopAsyncIteration:
                    return
                body = b"event: message\ndata: " + dumps(message) + b"\n\n"
                await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            if step is not None:
                step.cancel()
                with contextlib.suppress(BaseException):
                    await step
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def watch_disconnect() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    pump_task = asyncio.create_task(pump())
    watch_task = asyncio.create_task(watch_disconnect())
    waiters: set[asyncio.Future[Any]] = {pump_task, watch_task}
    for event in (abort, stop):
        if event is not None:
            waiters.add(asyncio.create_task(event.wait()))
    disconnected = True
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        disconnected = watch_task.done()
    finally:
        for t in waiters:
            t.cancel()
        for t in waiters:
            with contextlib.suppress(BaseException):
                await t
    if pump_task.done() and not pump_task.cancelled() and pump_task.exception() is not None:
        log.error("SSE stream failed", exc_info=pump_task.exception())
    if not disconnected:
        # The client is still there: end the body properly (also after an abort or a failure).
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
