"""One MCP session with an upstream, through the official MCP Python SDK's client.

The SDK's transports are anyio context managers, which must be left by the task that entered them:
a ``Connection`` holds its session open in a task of its own, and calls are made on it from any
task. What the upstream asks of its client (elicitation, sampling, roots) goes to the ``Asker`` of
the call in flight: a Streamable HTTP call has a session of its own (``per_call``), a stdio server
has one session, and a question reaches its call when that call is the only one in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any, Final, Protocol

import httpx
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.context import RequestContext
from mcp.shared.exceptions import McpError

from service.upstream.config import UpstreamConfig, safe_url

CLIENT_INFO: Final = types.Implementation(name="mcp-task-service", version="0.1.0")
CONNECT_TIMEOUT_S: Final = 10.0
CLOSE_S: Final = 5.0  # how long a session may take to leave the SDK's contexts before it is cancelled
# After a call is given up, a question already on its way (the server sent it before it saw our
# notifications/cancelled) could still arrive: none is relayed for this long (a round trip and more).
ABANDON_QUIET_S: Final = 1.0
NO_CALL: Final = "this question cannot be told apart from another call's (several calls share the stdio session)"


class Asker(Protocol):
    """Where one call's upstream questions go (its tool context, wrapped)."""

    async def elicit(self, params: types.ElicitRequestParams) -> types.ElicitResult | types.ErrorData: ...

    async def sample(self, params: types.CreateMessageRequestParams) -> types.CreateMessageResult | types.ErrorData: ...

    async def roots(self) -> types.ListRootsResult | types.ErrorData: ...

    def touched(self) -> None:
        """The upstream sent something for this call (it is alive)."""


class _Session(ClientSession):
    """The SDK's client session, answering the server's questions off its receive loop: the SDK
    awaits each request's handler in that loop, so a question waiting for a person would hold up
    every reply and notification of the session (a stdio server's session carries every call of
    the process). Pings are answered in the loop, as before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.questions: set[asyncio.Task[None]] = set()

    async def _received_request(self, responder: Any) -> None:
        if isinstance(responder.request.root, types.PingRequest):
            await super()._received_request(responder)
            return
        question = asyncio.ensure_future(super()._received_request(responder))
        self.questions.add(question)
        question.add_done_callback(self.questions.discard)


class ConnectFailed(Exception):
    """The session could not be opened: the message says what happened, in one line. ``refused``:
    the server answered our ``initialize`` with a refusal (``refused_initialize``)."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def _error(message: str) -> types.ErrorData:
    return types.ErrorData(code=types.INVALID_REQUEST, message=message)


class Connection:
    """One session. ``askers``: the calls in flight on it, by id. ``pool``: the upstream's HTTP
    connection pool, shared by its sessions."""

    def __init__(
        self, config: UpstreamConfig, *, headers: dict[str, str], pool: httpx.AsyncBaseTransport | None = None,
        on_notification: Callable[[types.ServerNotification], Awaitable[None]] | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self._headers = headers
        self._pool = pool
        self._on_notification = on_notification
        self.askers: dict[int, Asker] = {}
        # Loop time until which no question is relayed: a call on it was just abandoned (timed out,
        # cancelled), and a question the server sent before it saw our notifications/cancelled could
        # arrive now and reach another caller (only a stdio server's session lives on after that).
        self.quiet_until = 0.0
        self.session: ClientSession | None = None
        self.server_info: types.InitializeResult | None = None
        self.ended = asyncio.Event()
        self.opened_at = 0.0  # loop time
        self.error: str | None = None
        self._stop = asyncio.Event()
        self._ready: asyncio.Future[None] | None = None
        self._holder: asyncio.Task[None] | None = None

    async def open(self, timeout_s: float = CONNECT_TIMEOUT_S) -> ClientSession:
        loop = asyncio.get_running_loop()
        self.opened_at = loop.time()
        self._ready = loop.create_future()
        self._holder = asyncio.create_task(self._hold(), name=f"upstream-{self.config.name}")
        try:  # (wait_for, not timeout(): a plain call's first step runs outside a task, service.concurrency.eager)
            await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except TimeoutError:
            await self.close()
            raise ConnectFailed(f"no answer to initialize within {timeout_s:g} s") from None
        except BaseException:  # refused, or our caller cancelled: nothing of the session stays behind
            await asyncio.shield(self.close())
            raise
        assert self.session is not None
        return self.session

    def lost(self, error: str) -> None:
        """A request found the transport gone (the server exited, the stream broke): end the session."""
        self.error = self.error or error
        self._stop.set()

    async def close(self) -> None:
        """End the session (its holder leaves the SDK's contexts); a caller's cancel still lands.
        One still opening (``initialize`` unanswered: the holder waits on the server, not on us) is
        cancelled, as is one that does not leave within CLOSE_S: a stdio server's process ends."""
        self._stop.set()
        holder = self._holder
        if holder is None or holder.done():
            return
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()  # (nobody waits for it any more)
            holder.cancel()
        await asyncio.wait({holder}, timeout=CLOSE_S)
        if not holder.done():
            holder.cancel()
            await asyncio.wait({holder}, timeout=CLOSE_S)

    async def _hold(self) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await self._transport(stack)
                session = await stack.enter_async_context(
                    _Session(
                        read, write, client_info=CLIENT_INFO, elicitation_callback=self._elicit,
                        sampling_callback=self._sample, list_roots_callback=self._roots,
                        logging_callback=self._logged, message_handler=self._message,
                        read_timeout_seconds=timedelta(days=1),
                    )
                )  # fmt: skip
                self.server_info = await session.initialize()
                self.session = session
                assert self._ready is not None
                self._ready.set_result(None)
                try:
                    await self._stop.wait()
                finally:
                    for question in list(session.questions):  # unanswered: the session ends with them
                        question.cancel()
        except BaseException as exc:
            self.error = self.error or describe(exc)
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(ConnectFailed(self.error, refused=refused_initialize(exc)))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.ended.set()

    async def _transport(self, stack: contextlib.AsyncExitStack) -> tuple[Any, Any]:
        c = self.config
        if c.url:
            # A client per session (its own headers) over the upstream's one connection pool; the SDK
            # leaves a client it was given open, and the pool outlives it.
            transport = _Watched(self._pool, self.lost) if self._pool is not None else None
            client = httpx.AsyncClient(
                headers=self._headers, timeout=httpx.Timeout(30.0, read=None), transport=transport
            )
            read, write, _ = await stack.enter_async_context(streamable_http_client(c.url, http_client=client))
            return read, write
        params = StdioServerParameters(
            command=c.command[0], args=list(c.command[1:]), env=dict(c.env) or None, cwd=c.cwd
        )
        return await stack.enter_async_context(stdio_client(params, errlog=sys.stderr))

    def abandoned(self) -> None:
        """A call on this session was given up: no question is relayed for ABANDON_QUIET_S."""
        self.quiet_until = asyncio.get_running_loop().time() + ABANDON_QUIET_S

    def _asker(self) -> Asker | None:
        """The call a question is for: the only one in flight, unless a call was abandoned on this
        session a moment ago (its question could arrive late and reach another caller)."""
        if len(self.askers) == 1 and asyncio.get_running_loop().time() >= self.quiet_until:
            return next(iter(self.askers.values()))
        return None

    async def _elicit(self, context: RequestContext[ClientSession, Any], params: types.ElicitRequestParams) -> Any:
        asker = self._asker()
        return await asker.elicit(params) if asker is not None else _error(NO_CALL)

    async def _sample(
        self, context: RequestContext[ClientSession, Any], params: types.CreateMessageRequestParams
    ) -> Any:
        asker = self._asker()
        return await asker.sample(params) if asker is not None else _error(NO_CALL)

    async def _roots(self, context: RequestContext[ClientSession, Any]) -> Any:
        asker = self._asker()
        return await asker.roots() if asker is not None else _error(NO_CALL)

    async def _logged(self, params: types.LoggingMessageNotificationParams) -> None:
        asker = self._asker()
        if asker is not None:
            asker.touched()

    async def _message(self, message: Any) -> None:
        if isinstance(message, types.ServerNotification) and self._on_notification is not None:
            await self._on_notification(message)


class _Watched(httpx.AsyncBaseTransport):
    """The upstream's pool, telling the session when the stream of one of its POSTs breaks off (the
    upstream died mid-call): the SDK's client then only logs it, and the call would wait for an
    answer that cannot come until idle_timeout_s."""

    def __init__(self, pool: httpx.AsyncBaseTransport, broken: Callable[[str], None]) -> None:
        self._pool = pool
        self._broken = broken

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._pool.handle_async_request(request)
        if request.method != "POST":
            return response
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_WatchedStream(response.stream, self._broken), extensions=response.extensions)  # fmt: skip

    async def aclose(self) -> None:  # the pool is the upstream's, shared by its sessions
        pass


class _WatchedStream(httpx.AsyncByteStream):
    def __init__(self, inner: Any, broken: Callable[[str], None]) -> None:
        self._inner = inner
        self._broken = broken

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except httpx.TransportError as exc:
            self._broken(f"the upstream broke off the call's stream: {describe(exc)}")
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()


def refused_initialize(exc: BaseException) -> bool:
    """Whether the server answered our ``initialize`` with a refusal (a JSON-RPC error, or HTTP 400,
    404, 405, 406 or 415): it is there but takes no 2025-11-25 session. Not a timeout, a transport
    failure, a 5xx or a refusal of our credentials (401, 403)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, McpError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in (400, 404, 405, 406, 415)


def describe(exc: BaseException) -> str:
    """What ended a transport, in one line: the innermost exception of anyio's groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from {safe_url(str(exc.request.url))}"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({str(exc) or 'connection refused'})"
    if isinstance(exc, asyncio.CancelledError):
        return "closed"
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
