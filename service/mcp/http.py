"""HTTP plumbing of the MCP endpoint: request headers, JSON bodies, a client that went away."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.types import Receive, Scope, Send

from service.mcp import jsonrpc


class RequestHeaders(Headers):
    """Starlette's ``Headers`` (read-only) answering ``get``, ``[]`` and ``in`` from a dict built once,
    in C, of the raw names and values: ``Headers`` scans and decodes the whole header list on every
    lookup, and a request makes about a dozen; a value is decoded only when asked for. The first
    of repeated headers wins, as with ``Headers.get``."""

    def __init__(self, scope: Scope) -> None:
        # What Headers' other methods read (not copied, as Headers does: nothing here changes it).
        self._list = scope["headers"]
        # Built last to first, so the first of repeated headers is the one kept. ASGI servers send
        # names lowercased; where one does not, they are lowercased here (the spec asks it of them).
        first = dict(reversed(self._list))
        if not all(map(bytes.islower, first)):
            first = {name.lower(): value for name, value in reversed(self._list)}
        self._first = first

    def __getitem__(self, key: str) -> str:
        value = self._first.get(key.lower().encode("latin-1"))
        if value is None:
            raise KeyError(key)
        return value.decode("latin-1")

    def get(self, key: str, default: Any = None) -> Any:
        value = self._first.get(key.lower().encode("latin-1"))
        return default if value is None else value.decode("latin-1")

    def __contains__(self, key: Any) -> bool:
        return isinstance(key, str) and key.lower().encode("latin-1") in self._first

    def raw_value(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lowercase) as sent, undecoded."""
        return self._first.get(name)


class RequestConnection(HTTPConnection):
    """The request as the authenticator sees it, sharing the request's ``RequestHeaders``."""

    def __init__(self, scope: Scope, receive: Receive, headers: RequestHeaders) -> None:
        super().__init__(scope, receive)
        self._request_headers = headers

    @property
    def headers(self) -> Headers:
        return self._request_headers


# The HTTP server's own way to answer a request and to say its client left, offered to the app
# in ``scope["extensions"]`` (an ASGI server extension): service/http_server.py implements it.
# Its methods name the request by its ASGI ``send`` or ``receive`` (the extension object is the
# connection's: nothing of a request refers back to it, so no request leaves a reference cycle).
# Without it (another ASGI server, httpx's ASGI transport in tests) the ASGI messages do the same.
DIRECT: str = "mcp.direct"


class DirectExchange(Protocol):
    # One value the app keeps with the connection, for its later requests (None at first; gone
    # with the connection): the endpoint keeps the principal of its Authorization header there.
    memo: Any

    def respond(
        self, request: Callable[..., Any], status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> bool:
        """Write the whole response at once (status line, headers, body); False when it cannot
        (a response already begun, a paused transport...): the ASGI messages must then do it."""

    def on_gone(self, request: Callable[..., Any], callback: Callable[[], None]) -> bool:
        """Call ``callback`` (at most once) if the client goes away before the response is complete;
        False when it cannot tell for this request (``receive`` must then be read)."""


def direct_exchange(scope: Scope) -> DirectExchange | None:
    extensions = scope.get("extensions")
    return extensions.get(DIRECT) if extensions else None


async def send_json(send: Send, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
    payload = b"" if body is None else jsonrpc.dumps(body)
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()] if headers else []
    if body is not None:
        raw.append((b"content-type", b"application/json"))
    raw.append((b"content-length", str(len(payload)).encode()))
    # One write for a whole answer when the sender offers it (McpEndpoint's, on our server).
    respond: Callable[[int, list[tuple[bytes, bytes]], bytes], bool] | None = getattr(send, "respond", None)
    if respond is not None and respond(status, raw, payload):
        return
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def client_gone(scope: Scope, receive: Receive) -> asyncio.Future[None]:
    """A future done when the request's client goes away (cancel it when no longer needed). On our
    server it is a plain future the connection completes; otherwise a task reading ``receive``."""
    direct = direct_exchange(scope)
    if direct is not None:
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not gone.done():
                gone.set_result(None)

        if direct.on_gone(receive, wake):
            return gone
    return asyncio.ensure_future(_disconnected(receive))


async def until_done_or_gone(scope: Scope, receive: Receive, running: asyncio.Future[Any]) -> None:
    """Wait until ``running`` is done or the request's client goes away, whichever is first."""
    gone = client_gone(scope, receive)
    try:
        await first_done(running, gone)
    finally:
        gone.cancel()


async def first_done(*futures: asyncio.Future[Any]) -> None:
    """Wait until one of ``futures`` is done (asyncio.wait's FIRST_COMPLETED without its sets)."""
    if any(f.done() for f in futures):
        return
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake(_f: asyncio.Future[Any]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for f in futures:
        f.add_done_callback(wake)
    try:
        await waiter
    finally:
        for f in futures:
            f.remove_done_callback(wake)
