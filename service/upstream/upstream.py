"""One upstream MCP server as this process sees it: whether it is up, its tools, its breaker, and
its calls.

A control session follows the server (connected with backoff, its tool list read at connect, on
``notifications/tools/list_changed`` and every ``REFRESH_S``). A call to a Streamable HTTP upstream
opens a session of its own (so the upstream's questions reach the right call); a stdio server's
one process and session carry every call of this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

import httpx
import pydantic
from mcp import types

from service.observability import metrics
from service.tools.api import ToolContext
from service.upstream.auth import Credentials, UpstreamAuthError
from service.upstream.breaker import Breaker
from service.upstream.calls import UpstreamFailure, bounded, call
from service.upstream.config import UpstreamConfig
from service.upstream.connection import ConnectFailed, Connection, describe
from service.upstream.ext_tasks import ExtCall
from service.upstream.modern import (
    PROTOCOL,
    BadAnswer,
    Modern,
    discover,
    list_tools,
    offers_tasks,
    speaks_tasks_extension,
)
from service.upstream.modern_watch import watch
from service.upstream.sessions import SessionPool
from service.upstream.tasks import TaskCall, runs_as_task

log = logging.getLogger(__name__)

REFRESH_S: Final = 60.0
LEGACY_RETRY_S: Final = 60.0  # an upstream followed on 2026-07-28 is offered a 2025-11-25 session again
PING_S: Final = 10.0
RETRY_BACKOFF_S: Final = (0.5, 2.0)  # a rerunnable upstream's failed call: tried again after these
PING_TIMEOUT_S: Final = 10.0
BACKOFF_S: Final = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Upstream:
    """``on_tools``: called with the upstream's exposed tools whenever they change (an empty list
    once it has been down for ``grace_s``)."""

    def __init__(
        self, config: UpstreamConfig, *, on_tools: Callable[[Upstream], None], grace_s: float,
        max_result_bytes: int,
    ) -> None:  # fmt: skip
        self.config = config
        self.credentials = Credentials(config.auth)
        self.breaker = Breaker(threshold=config.circuit_failures, open_s=config.circuit_open_s)
        self.tools: dict[str, types.Tool] = {}
        self.listed = False  # whether ``tools`` is what the server said (vs. dropped after the grace)
        self.up = False
        self.down_since: float | None = time.time()
        self.last_error: str | None = None
        self._on_tools = on_tools
        self._grace_s = grace_s
        self._max_result_bytes = max_result_bytes
        # A session holds a connection (the SDK's GET stream), a call on it one more: idle, busy and
        # closing sessions, the control session and 2026-07-28 requests all fit.
        self._pool = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=4 * config.max_concurrency + 8))
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._sessions = SessionPool(config.max_concurrency)
        self._modern = None if config.url is None else Modern(
            config.url, httpx.AsyncClient(transport=self._pool), self.credentials.headers, max_result_bytes,
            on_unauthorized=self.credentials.forget,
        )  # fmt: skip
        self.extension = False  # it speaks 2026-07-28 with the Tasks extension: calls go that way
        self.modern_only = False  # it refused initialize but speaks 2026-07-28: followed and called on that wire
        self._control: Connection | None = None
        self._refresh = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self.tried = asyncio.Event()  # its first connection came up or failed
        self.on_change: Callable[[], None] = lambda: None
        self._circuit_seen = "closed"  # up, down, its tools or its circuit changed

    # ---- following the server --------------------------------------------------------------

    def start(self) -> None:
        metrics.upstream_configured(self.config.name)
        self._loop = asyncio.create_task(self._follow(), name=f"upstream-{self.config.name}-follow")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(BaseException):
                await self._loop
        if self._control is not None:
            await self._control.close()
        await self._sessions.close()
        await self._pool.aclose()

    async def _follow(self) -> None:
        failures = 0
        while True:
            try:
                conn = await self._connect(on_notification=self._notified)
            except Exception as exc:  # (anything it or our credentials raised: down, tried again)
                # It refused the 2025-11-25 session: it may speak only 2026-07-28, followed that way a while.
                if isinstance(exc, ConnectFailed) and exc.refused and await self._follow_modern():
                    failures = 0 if self.up else failures + 1  # (down: it failed there too)
                    await self._wait_down(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                    continue
                self._went_down(str(exc) if isinstance(exc, ConnectFailed | UpstreamAuthError) else describe(exc))
                delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                await self._wait_down(delay)
                continue
            failures = 0
            self._control = conn
            self.modern_only = False  # a 2025-11-25 session again: its calls go that way
            try:
                if self._modern is not None:  # before the tools are published: calls go the way it says
                    self._found_extension(await speaks_tasks_extension(self._modern))
                await self._list(conn)
                self._came_up()
                await self._watch(conn)
            except Exception as exc:  # a listing the server answered badly: down, try again
                conn.error = f"tools/list or ping failed: {describe(exc)}"
            finally:
                self._control = None
                await conn.close()
            self._went_down(conn.error or "the session ended")
            await self._wait_down(BACKOFF_S[0])

    async def _watch(self, conn: Connection) -> None:
        """Until the session ends: re-list on list_changed and every REFRESH_S, ping every PING_S
        (a server that went away between calls is noticed then)."""
        assert conn.session is not None
        loop = asyncio.get_running_loop()
        listed = loop.time()
        while not conn.ended.is_set():
            ended = asyncio.ensure_future(conn.ended.wait())
            changed = asyncio.ensure_future(self._refresh.wait())
            try:
                await asyncio.wait({ended, changed}, timeout=PING_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ended.cancel()
                changed.cancel()
            if conn.ended.is_set():
                return
            if self._refresh.is_set() or loop.time() - listed >= REFRESH_S:
                self._refresh.clear()
                await self._list(conn)
                listed = loop.time()
            else:
                await asyncio.wait_for(conn.session.send_ping(), PING_TIMEOUT_S)

    async def _follow_modern(self) -> bool:
        """An HTTP upstream that refused our 2025-11-25 session but answers 2026-07-28's
        ``server/discover``: followed on that wire (``modern_watch``) for LEGACY_RETRY_S, or until a
        ping or a listing fails (down then); True either way, and a 2025-11-25 session is tried
        next. ``modern_only`` stays set until one opens (calls meanwhile go on 2026-07-28). False,
        at once, when it does not speak 2026-07-28 either."""
        modern = self._modern
        if modern is None:
            return False
        try:
            found = await discover(modern)
        except Exception:  # credentials it cannot have, a header it cannot send: down, as the connect said
            return False
        if found is None:
            return False
        self.modern_only = True
        self._found_extension(offers_tasks(found))

        async def relist() -> None:
            self._publish(await list_tools(modern))

        try:
            await relist()
            self._came_up()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LEGACY_RETRY_S):
                    await watch(modern, self._refresh, relist, ping_s=PING_S, ping_timeout_s=PING_TIMEOUT_S,
                                refresh_s=REFRESH_S)  # fmt: skip
        except Exception as exc:  # as the 2025-11-25 session's: down, tried again
            self._went_down(f"on 2026-07-28: {describe(exc)}")
        return True

    async def _wait_down(self, delay: float) -> None:
        """Wait before the next try; past the grace, the tools leave the list."""
        await asyncio.sleep(delay)
        if self.tools and self.down_since is not None and time.time() - self.down_since >= self._grace_s:
            self.tools, self.listed = {}, False
            self._on_tools(self)
            self.on_change()

    async def _notified(self, note: types.ServerNotification) -> None:
        if isinstance(note.root, types.ToolListChangedNotification):
            self._refresh.set()

    async def _list(self, conn: Connection) -> None:
        assert conn.session is not None
        listed: list[types.Tool] = []
        cursor: str | None = None
        while True:
            page = await conn.session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
            listed.extend(page.tools)
            cursor = page.nextCursor
            if not cursor:
                break
        self._publish(listed)

    def _publish(self, listed: list[types.Tool] | list[dict[str, Any]]) -> None:
        """The upstream's tools (as the SDK read them, or as 2026-07-28's JSON), those it exposes ours."""
        try:
            tools = [t if isinstance(t, types.Tool) else types.Tool.model_validate(t) for t in listed]
        except pydantic.ValidationError:
            raise BadAnswer("a tools/list answer with a tool that is not MCP's") from None
        exposed = {t.name: t for t in tools if self.config.exposes(t.name)}
        if exposed != self.tools or not self.listed:
            self.tools, self.listed = exposed, True
            self._on_tools(self)
            self.on_change()

    def _found_extension(self, found: bool) -> None:
        if found != self.extension:
            log.info(
                "upstream %s %s the 2026-07-28 Tasks extension", self.config.name, "offers" if found else "dropped"
            )
        self.extension = found

    def _came_up(self) -> None:
        if not self.up:
            log.info("upstream %s is up (%d tools)", self.config.name, len(self.tools))
        metrics.upstream_up.labels(self.config.name).set(1)
        self.up, self.down_since, self.last_error = True, None, None
        self.tried.set()
        self.on_change()

    def _went_down(self, error: str) -> None:
        if self.up or self.last_error is None:
            log.warning("upstream %s is down: %s", self.config.name, error)
        if self.up or self.down_since is None:
            self.down_since = time.time()
        metrics.upstream_up.labels(self.config.name).set(0)
        self.up, self.last_error = False, error
        self.tried.set()
        self.on_change()

    async def _connect(self, *, forward: dict[str, str] | None = None, **kw: Any) -> Connection:
        """A session with our credentials (never the caller's token: no pass-through) and, for a
        call, the ``[upstream.forward]`` headers naming its caller."""
        headers = {**(forward or {}), **await self.credentials.headers()}
        conn = Connection(self.config, headers=headers, pool=self._pool, **kw)
        try:
            await conn.open()
        except ConnectFailed as exc:
            if "HTTP 401" in str(exc):  # a token it no longer takes: fetch a new one next time
                self.credentials.forget()
            raise
        return conn

    def _forwarded(self, ctx: ToolContext) -> dict[str, str]:
        return self.config.forward.headers(ctx.caller)

    # ---- calls -------------------------------------------------------------------------------

    async def run(self, tool: str, arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        """Call the upstream's tool for one of our calls or tasks. A call of a ``rerunnable``
        upstream that failed because of the upstream (unreachable, closed, silent, garbage, down while
        it restarts) is tried again after RETRY_BACKOFF_S, while its circuit lets calls through; no
        other is."""
        for attempt, delay in enumerate((*RETRY_BACKOFF_S, None), start=1):
            try:
                return await self._attempt(tool, arguments, ctx)
            except UpstreamFailure as exc:
                if delay is None or not (self.config.rerunnable and (exc.breaks or exc.refused)):
                    if attempt > 1:
                        raise UpstreamFailure(f"{exc.message} (tried {attempt} times)", breaks=False) from None
                    raise
                log.info("upstream %s: %s; trying again in %g s", self.config.name, exc.message, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable: the last attempt's failure is raised")

    async def _attempt(self, tool: str, arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        name = self.config.name
        retry_in = self.breaker.refuses()
        if retry_in is not None:
            metrics.upstream_calls.labels(name, "refused").inc()
            raise UpstreamFailure(
                f"upstream {name!r} is failing (circuit open): calls are refused for {max(1, round(retry_in))} s "
                f"more; try again then (last error: {self.breaker.last_error or self.last_error})",
                breaks=False,
            )
        outcome = "cancelled"
        started = time.monotonic()
        async with self._slots:
            in_flight = metrics.upstream_in_flight.labels(name)
            in_flight.inc()
            try:
                result = await self._run(tool, arguments, ctx)
                outcome = "tool_error" if result.get("isError") else "ok"
            except UpstreamFailure as exc:
                outcome = "refused" if exc.refused else "error"
                if exc.breaks:
                    self.breaker.failed(exc.message)
                elif exc.refused:  # not sent: says nothing new of it, but a trial may be made again
                    self.breaker.settled()
                else:  # it answered: alive
                    self.breaker.succeeded()
                raise
            except BaseException:  # our cancel, our client's failure: says nothing of the upstream
                self.breaker.settled()
                raise
            finally:
                in_flight.dec()
                metrics.upstream_calls.labels(name, outcome).inc()
                metrics.upstream_call_seconds.labels(name).observe(time.monotonic() - started)
                circuit = self.breaker.state()
                metrics.upstream_circuit_open.labels(name).set(1 if circuit == "open" else 0)
                if circuit != self._circuit_seen:
                    self._circuit_seen = circuit
                    self.on_change()
        self.breaker.succeeded()
        return result

    async def _run(self, tool: str, arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        c = self.config
        note = await ctx.recall()
        ours = note is not None and note.get("upstream") == c.name
        on_modern = self.extension or self.modern_only
        if self._modern is not None and (note.get("wire") == PROTOCOL if ours and note else on_modern):
            result = await ExtCall(self._modern, c, tool, ctx, self._forwarded(ctx)).run(arguments, note)
            return bounded(result, f"upstream {c.name!r} (tool {tool!r})", self._max_result_bytes)
        if c.transport == "stdio":
            conn = self._control
            if conn is None or conn.ended.is_set():
                raise UpstreamFailure(  # fast already: not the breaker's to count
                    f"upstream {c.name!r} is down ({self.last_error or 'starting'}): try again later",
                    breaks=False,
                    refused=True,
                )
            return await self._call(conn, tool, arguments, ctx, note)
        forward = self._forwarded(ctx)
        key = (("caller", repr(ctx.caller)), *sorted(forward.items()))
        for fresh in (False, True):  # a reused session the upstream dropped meanwhile: once more, anew
            if fresh:  # (what the first try noted: an upstream task it made is followed, not made again)
                note = await ctx.recall()
            try:
                conn, reused = await self._sessions.take(key, lambda: self._connect(forward=forward), fresh=fresh)
            except (ConnectFailed, UpstreamAuthError) as exc:
                raise UpstreamFailure(f"upstream {c.name!r} could not be reached: {exc}", breaks=True) from None
            ended_well = False
            try:
                result = await self._call(conn, tool, arguments, ctx, note)
                ended_well = True
                return result
            except UpstreamFailure as exc:
                if not (exc.stale and reused):
                    raise
            finally:
                self._sessions.give(key, conn, reusable=ended_well)
        raise AssertionError("unreachable: a fresh session's failure is raised")

    async def _call(
        self, conn: Connection, tool: str, arguments: dict[str, Any], ctx: ToolContext, note: dict[str, Any] | None
    ) -> dict[str, Any]:
        """As a task of the upstream's when it takes this tool's calls as tasks (followed, and
        resumed after a takeover), else as one request held open for the call's life."""
        if runs_as_task(conn, self.tools.get(tool)) or (note is not None and note.get("upstream") == self.config.name):
            result = await TaskCall(conn, self.config, tool, ctx).run(arguments, note)
            return bounded(result, f"upstream {self.config.name!r} (tool {tool!r})", self._max_result_bytes)
        return await call(conn, self.config, tool, arguments, ctx, max_result_bytes=self._max_result_bytes)

    def status(self) -> dict[str, Any]:
        """What ``mcp-tasks upstreams`` shows for this process's view."""
        since = self.down_since
        return {
            "name": self.config.name,
            "transport": self.config.transport,
            "tasks": self._tasks_wire(),
            "state": "up" if self.up else "down",
            "down_since": None if since is None else datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds"),
            "circuit": self.breaker.state(),
            "tools": sorted(self.tools),
            "last_error": self.last_error or self.breaker.last_error,
        }

    def _tasks_wire(self) -> str | None:
        """How calls become the upstream's tasks: its 2026-07-28 extension, its 2025-11-25 tasks (for
        the tools that take them), or not at all."""
        if self.extension:
            return "2026-07-28"
        info = self._control.server_info if self._control is not None else None
        return "2025-11-25" if info is not None and info.capabilities.tasks is not None else None
