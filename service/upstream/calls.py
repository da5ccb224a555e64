"""One call of an upstream tool, as the client the MCP spec asks for: a timeout on every request
(``timeout_s``, whatever the upstream reports), an idle timeout that anything the upstream sends
for the call resets (``idle_timeout_s``; not counted while the call waits for our client's answer),
``notifications/cancelled`` sent when we stop waiting, and a late answer ignored. The upstream's
progress goes to the tool context, its questions to our client, its answer becomes the outcome."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, TypeVar

import orjson
import pydantic
from mcp import types
from mcp.shared.exceptions import McpError

from service.observability import tracing
from service.tools.api import InputNotSupported, ToolContext, ToolFailure
from service.tools.context import progress_text
from service.upstream.config import UpstreamConfig
from service.upstream.connection import Connection, describe

log = logging.getLogger(__name__)

# The upstream's answer keeps these keys of a CallToolResult (its _meta is the upstream's own).
RESULT_KEYS: Final = ("content", "structuredContent", "isError")
# What the SDK's Streamable HTTP client answers a request with when the server says 404 to its
# session (mcp/client/streamable_http.py, "Session terminated").
SESSION_TERMINATED: Final = 32600


class UpstreamFailure(ToolFailure):
    """The call failed because of the upstream (not a tool error it answered with): counts
    against its circuit breaker when ``breaks``."""

    def __init__(
        self, message: str, *, breaks: bool, lost: bool = False, refused: bool = False, stale: bool = False
    ) -> None:
        super().__init__(message)
        self.breaks = breaks
        self.lost = lost  # the session is gone
        self.refused = refused  # not sent: the upstream is down
        self.stale = stale  # the upstream had dropped the session: the call never reached its tool


T = TypeVar("T")


async def following(
    ctx: ToolContext, task_id: str, follow: Coroutine[Any, Any, T], cancel: Callable[[str], Awaitable[None]]
) -> T:
    """``follow`` of the upstream's task ``task_id`` to its end. Our task cancelled: the upstream's
    too; this run merely stopping (a shutdown, a takeover): the upstream task goes on, for the run
    that follows it next; a timeout or a failure: we stop following, so it stops too."""
    try:
        return await follow
    except asyncio.CancelledError:
        if await ctx.cancelled():
            await cancel(task_id)
        raise
    except BaseException:
        await cancel(task_id)
        raise


class CallAsker:
    """One call's side of the upstream's questions: each asks our client through the tool context."""

    def __init__(self, ctx: ToolContext, loop: asyncio.AbstractEventLoop) -> None:
        self.ctx = ctx
        self.loop = loop
        self.last = loop.time()
        self.asking = 0
        self.failure: ToolFailure | None = None  # a question that ended our call (no answer in time, ...)
        self.pending: set[asyncio.Task[Any]] = set()

    def touched(self) -> None:
        self.last = self.loop.time()

    async def _ask(self, question: Any) -> Any:
        """Run one question as a task of ours (the SDK's callback runs in the session's task, which
        our cancel does not reach): cancelled when the call ends."""
        self.asking += 1
        inner = asyncio.ensure_future(question)
        self.pending.add(inner)
        try:
            await asyncio.wait({inner})
        finally:  # the SDK's side gave up (its session ended): so does the question
            if not inner.done():
                inner.cancel()
            self.pending.discard(inner)
            self.asking -= 1
            self.touched()
        if inner.cancelled():
            return types.ErrorData(code=types.INVALID_REQUEST, message="the call was cancelled")
        exc = inner.exception()
        if isinstance(exc, InputNotSupported):
            return types.ErrorData(code=types.METHOD_NOT_FOUND, message=str(exc))
        if isinstance(exc, ToolFailure):
            self.failure = exc
            return types.ErrorData(code=types.INVALID_REQUEST, message=exc.message)
        if isinstance(exc, pydantic.ValidationError):  # (an answer that is not the result asked for)
            return types.ErrorData(code=types.INVALID_PARAMS, message="our client's answer is not a valid result")
        if exc is not None:  # answered as an error: raised into the SDK, nothing would answer the upstream
            log.warning("a question of the upstream could not be relayed: %s", describe(exc))
            return types.ErrorData(code=types.INTERNAL_ERROR, message="the question could not be relayed")
        return inner.result()

    async def elicit(self, params: types.ElicitRequestParams) -> types.ElicitResult | types.ErrorData:
        if not isinstance(params, types.ElicitRequestFormParams):
            return types.ErrorData(code=types.INVALID_PARAMS, message="only form elicitation is relayed")

        async def ask() -> types.ElicitResult:
            answer = await self.ctx.elicit(params.message, params.requestedSchema)
            return types.ElicitResult(action=answer.action, content=answer.content)

        result: types.ElicitResult | types.ErrorData = await self._ask(ask())
        return result

    async def sample(self, params: types.CreateMessageRequestParams) -> types.CreateMessageResult | types.ErrorData:
        async def ask() -> types.CreateMessageResult:
            wire = params.model_dump(by_alias=True, exclude_none=True, mode="json")
            wire.pop("_meta", None)
            return types.CreateMessageResult.model_validate(await self.ctx.sample(wire))

        result: types.CreateMessageResult | types.ErrorData = await self._ask(ask())
        return result

    async def roots(self) -> types.ListRootsResult | types.ErrorData:
        async def ask() -> types.ListRootsResult:
            return types.ListRootsResult.model_validate({"roots": await self.ctx.list_roots()})

        result: types.ListRootsResult | types.ErrorData = await self._ask(ask())
        return result

    def end(self) -> None:
        for task in self.pending:
            task.cancel()


async def call(
    conn: Connection, config: UpstreamConfig, tool: str, arguments: dict[str, Any], ctx: ToolContext, *,
    max_result_bytes: int,
) -> dict[str, Any]:  # fmt: skip
    """The upstream's CallToolResult as a dict; an ``UpstreamFailure`` for anything else. Tracing
    on: a client span, whose context the request carries in ``_meta`` (the MCP conventions)."""
    with tracing.client_span(f"tools/call {tool}", {"mcp.method.name": "tools/call", "gen_ai.tool.name": tool,
                                                    "mcp_tasks.upstream": config.name}):  # fmt: skip
        meta: dict[str, Any] = {}
        tracing.inject(meta)
        try:
            return await _call(conn, config, tool, arguments, ctx, meta, max_result_bytes=max_result_bytes)
        except UpstreamFailure:
            tracing.failed("upstream")
            raise


async def _call(
    conn: Connection, config: UpstreamConfig, tool: str, arguments: dict[str, Any], ctx: ToolContext,
    meta: dict[str, Any], *, max_result_bytes: int,
) -> dict[str, Any]:  # fmt: skip
    session = conn.session
    assert session is not None
    loop = asyncio.get_running_loop()
    asker = CallAsker(ctx, loop)
    label = f"upstream {config.name!r} (tool {tool!r})"

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        asker.touched()
        await ctx.progress(progress, total, message)
        await ctx.status(progress_text(progress, total, message))  # the task's statusMessage, on either wire

    request = types.ClientRequest(
        types.CallToolRequest(
            params=types.CallToolRequestParams(name=tool, arguments=arguments, **({"_meta": meta} if meta else {}))
        )
    )
    ids: list[int] = []

    async def send() -> types.CallToolResult:
        # The id the SDK gives this request, for notifications/cancelled: the session's next one,
        # read in the same step as send_request takes it (nothing awaits in between).
        ids.append(session._request_id)
        return await session.send_request(request, types.CallToolResult, progress_callback=on_progress)

    sent = asyncio.ensure_future(send())
    conn.askers[id(asker)] = asker
    started = loop.time()
    try:
        while not sent.done():
            if asker.failure is not None:
                raise asker.failure
            now = loop.time()
            total_left = started + config.timeout_s - now
            idle_left = config.idle_timeout_s if asker.asking else asker.last + config.idle_timeout_s - now
            if total_left <= 0:
                raise UpstreamFailure(
                    f"{label} did not answer within timeout_s={config.timeout_s:g} s: the call was cancelled",
                    breaks=False,
                )
            if idle_left <= 0:
                raise UpstreamFailure(
                    f"{label} sent nothing for idle_timeout_s={config.idle_timeout_s:g} s (no progress, no "
                    "message): the call was cancelled",
                    breaks=True,
                )
            ended = asyncio.ensure_future(conn.ended.wait())
            try:
                await asyncio.wait(
                    {sent, ended}, timeout=min(total_left, idle_left), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                ended.cancel()
            if conn.ended.is_set() and not sent.done():
                raise UpstreamFailure(f"{label} closed the connection during the call ({conn.error})", breaks=True)
        if asker.failure is not None:  # a question ended our call, though the upstream answered
            raise asker.failure
        result = _result(sent, label)
    except UpstreamFailure as exc:
        if exc.lost:
            conn.lost(exc.message)
        raise
    finally:
        conn.askers.pop(id(asker), None)
        asker.end()
        if not sent.done():  # we stopped waiting (a timeout, a failure, our cancel): so does the upstream
            sent.cancel()
            conn.abandoned()
            if ids:
                await _cancel_upstream(conn, ids[0])
    return bounded(result, label, max_result_bytes)


def bounded(result: dict[str, Any], label: str, max_result_bytes: int) -> dict[str, Any]:
    """The result, unless its JSON is above MCP_TASKS_MAX_RESULT_BYTES (then the call fails)."""
    size = len(orjson.dumps(result))
    if size > max_result_bytes:
        raise UpstreamFailure(
            f"{label} answered with {size} bytes, above MCP_TASKS_MAX_RESULT_BYTES={max_result_bytes}: the result "
            "was not kept",
            breaks=False,
        )
    return result


def _result(sent: asyncio.Future[types.CallToolResult], label: str) -> dict[str, Any]:
    try:
        answer = sent.result()
    except McpError as exc:
        if exc.error.code == types.CONNECTION_CLOSED:
            raise UpstreamFailure(f"{label} closed the connection during the call", breaks=True, lost=True) from None
        if exc.error.code == SESSION_TERMINATED:  # the SDK's answer to a 404: the upstream dropped the session
            raise UpstreamFailure(f"{label} no longer knows our session", breaks=False, lost=True, stale=True) from None
        raise UpstreamFailure(
            f"{label} answered with error {exc.error.code}: {exc.error.message[:500]}", breaks=False
        ) from None
    except pydantic.ValidationError:
        raise UpstreamFailure(f"{label} answered with something that is not a CallToolResult", breaks=True) from None
    except (asyncio.CancelledError, ToolFailure):
        raise
    except Exception as exc:
        raise UpstreamFailure(f"{label} could not be called: {describe(exc)}", breaks=True) from None
    wire = answer.model_dump(by_alias=True, exclude_none=True, mode="json")
    return {k: wire[k] for k in RESULT_KEYS if k in wire}


async def _cancel_upstream(conn: Connection, request_id: int) -> None:
    """Tell the upstream we stopped waiting (its answer, if one comes, is dropped by the SDK)."""
    session = conn.session
    if session is None or conn.ended.is_set():
        return
    note = types.ClientNotification(
        types.CancelledNotification(params=types.CancelledNotificationParams(requestId=request_id, reason="cancelled"))
    )
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.shield(session.send_notification(note)), 2)
