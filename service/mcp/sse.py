"""Server-Sent Events over raw ASGI, with keep-alives and deterministic clean-up on disconnect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import Receive, Scope, Send

from service.mcp.jsonrpc import dumps

KEEPALIVE_S = 15.0


async def send_sse(
    send: Send,
    receive: Receive,
    messages: AsyncIterator[dict[str, Any]],
    *,
    headers: dict[str, str] | None = None,
    keepalive_s: float = KEEPALIVE_S,
) -> None:
    """Stream ``messages`` as SSE events until exhausted or the client goes away.

    A disconnect is not a cancellation of the underlying work (H-POST-11, T-RES-8): it only ends
    this stream, and ``messages`` is closed so its clean-up (e.g. releasing undelivered
    elicitations) runs at once.
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
        try:
            while True:
                try:
                    message = await asyncio.wait_for(anext(iterator), timeout=keepalive_s)
                except TimeoutError:
                    await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})
                    continue
                except StopAsyncIteration:
                    return
                body = b"event: message\ndata: " + dumps(message) + b"\n\n"
                await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
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
    try:
        done, _ = await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (pump_task, watch_task):
            t.cancel()
        for t in (pump_task, watch_task):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    if pump_task in done and not pump_task.cancelled() and pump_task.exception() is None:
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def is_sse_scope(scope: Scope) -> bool:  # pragma: no cover - helper for logging middleware
    return scope.get("method") == "GET"
