"""A lean HTTP/1.1 keep-alive client for the load generator: one connection, one request at a time.

httpx spent about 1 ms of CPU per request, which made the generator the ceiling of every run; this
client does only what the bench needs: pre-built request heads, Content-Length, chunked and
read-until-close bodies, and reconnecting when the server closes the connection. It never reads proxy
settings from the environment: a proxy would silently be measured too.

Exceptions (after any of them the connection is discarded; the next request opens a new one)::

    HttpError
    ├── ConnectFailed     the TCP (or TLS) connection could not be opened
    ├── ConnectionLost    the server closed or reset the connection before the answer was complete
    └── BadResponse       the bytes are not an HTTP/1.x response this client can frame
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

from service.domain.values import frozen

_READ_SIZE: Final = 65_536
_NO_BODY, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)


class HttpError(Exception):
    """The request got no complete HTTP answer; the connection it used has been discarded."""


class ConnectFailed(HttpError):
    pass


class ConnectionLost(HttpError):
    pass


class BadResponse(HttpError):
    pass


# Every error a read or write can end with; _translated is the one mapping from the lower-level ones:
# IncompleteReadError is an EOFError, ssl.SSLError an OSError, a malformed number (status, length,
# chunk size) a ValueError.
_FAILURES: Final = (HttpError, OSError, EOFError, ValueError, asyncio.LimitOverrunError)


def _translated(exc: BaseException) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, ValueError | asyncio.LimitOverrunError):
        return BadResponse(str(exc))
    return ConnectionLost(type(exc).__name__)


@frozen
class Endpoint:
    """Where requests go: address, request target and Host header, and TLS for https."""

    host: str
    port: int
    target: str
    authority: str
    tls: ssl.SSLContext | None = None

    @classmethod
    def from_url(cls, url: str, ssl_context: ssl.SSLContext | None = None) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL with a host: {url!r}")
        secure = parts.scheme == "https"
        if secure and ssl_context is None:
            ssl_context = ssl.create_default_context()
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(
            host=parts.hostname,
            port=parts.port or (443 if secure else 80),
            target=target,
            authority=parts.netloc.rpartition("@")[2],
            tls=ssl_context if secure else None,
        )

    def head(self, method: str, headers: Mapping[str, str]) -> bytes:
        """A request head up to (not including) Content-Length and the blank line; built once, sent often."""
        lines = [f"{method} {self.target} HTTP/1.1", f"Host: {self.authority}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        return ("\r\n".join(lines) + "\r\n").encode("latin-1")


class Connection:
    """One persistent connection to an endpoint, opened on first use and reopened whenever it was lost.

    A response must be read to its end before the next request; one that was abandoned (a timeout,
    an SSE stream left open) marks the connection busy, and the next request starts on a fresh one.
    """

    __slots__ = ("_busy", "_reader", "_writer", "endpoint", "opened")

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._busy = False
        self.opened = 0  # connections opened so far: reconnects show up here

    async def request(self, head: bytes, body: bytes) -> Response:
        """Send one request (``head`` from Endpoint.head) and return once the response head is read."""
        reader, writer = self._reader, self._writer
        # An idle connection the server has closed (keep-alive timeout) reads as EOF: never reuse it.
        if reader is None or writer is None or self._busy or reader.at_eof():
            reader, writer = await self._open()
        self._busy = True
        try:
            writer.write(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body))
            return await _read_head(reader, self)
        except _FAILURES as exc:
            self.discard()
            raise _translated(exc) from None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.discard()
        ep = self.endpoint
        try:
            reader, writer = await asyncio.open_connection(ep.host, ep.port, ssl=ep.tls, limit=_READ_SIZE)
        except OSError as exc:
            raise ConnectFailed(type(exc).__name__) from None
        self._reader, self._writer, self._busy = reader, writer, False
        self.opened += 1
        return reader, writer

    def release(self, reader: asyncio.StreamReader, reusable: bool) -> None:
        """The response on ``reader`` was read to its end; keep the connection if the server allows it."""
        if reader is not self._reader:
            return  # a response abandoned earlier: its connection is already gone
        if reusable:
            self._busy = False
        else:
            self.discard()

    def discard(self, reader: asyncio.StreamReader | None = None) -> None:
        """Close the connection (only if it is still the one ``reader`` belongs to, when given)."""
        if reader is not None and reader is not self._reader:
            return
        writer = self._writer
        self._reader = self._writer = None
        self._busy = False
        if writer is not None:
            writer.close()

    async def close(self) -> None:
        writer = self._writer
        self.discard()
        if writer is not None:
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class Response:
    """A status, headers (lower-cased names, repeated ones joined with ", ") and a body read by the caller."""

    __slots__ = ("_conn", "_framing", "_reader", "_remaining", "_reusable", "headers", "status")

    def __init__(
        self, conn: Connection, reader: asyncio.StreamReader, status: int, headers: dict[str, str], http10: bool
    ) -> None:
        self.status = status
        self.headers = headers
        self._conn = conn
        self._reader = reader
        self._remaining = 0
        tokens = headers.get("connection", "").lower()
        self._reusable = "close" not in tokens and (not http10 or "keep-alive" in tokens)
        coding = headers.get("transfer-encoding")
        if status in (204, 304):
            self._framing = _NO_BODY
        elif coding is not None:
            # Chunked must be the last coding; any other framing by transfer coding ends with the connection.
            self._framing = _CHUNKED if coding.rpartition(",")[2].strip().lower() == "chunked" else _UNTIL_CLOSE
        elif (length := headers.get("content-length")) is not None:
            self._remaining = int(length)
            if self._remaining < 0:
                raise BadResponse("negative Content-Length")
            self._framing = _LENGTH if self._remaining else _NO_BODY
        else:
            self._framing = _UNTIL_CLOSE
        if self._framing == _UNTIL_CLOSE:
            self._reusable = False
        elif self._framing == _NO_BODY:
            conn.release(reader, self._reusable)

    @property
    def done(self) -> bool:
        return self._framing == _NO_BODY

    async def read(self) -> bytes:
        """The whole (remaining) body."""
        if self._framing == _LENGTH:
            try:
                data = await self._reader.readexactly(self._remaining)
            except _FAILURES as exc:
                self._conn.discard(self._reader)
                raise _translated(exc) from None
            self._finish()
            return data
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    async def next_chunk(self) -> bytes:
        """The next piece of the body as it arrives; ``b""`` once the body has ended."""
        framing, reader = self._framing, self._reader
        if framing == _NO_BODY:
            return b""
        try:
            if framing == _CHUNKED:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.partition(b";")[0], 16)  # int() ignores the surrounding whitespace
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":
                        pass  # trailer fields, unused
                    self._finish()
                    return b""
                data = await reader.readexactly(size + 2)
                if not data.endswith(b"\r\n"):
                    raise BadResponse("chunk not followed by CRLF")
                return data[:-2]
            data = await reader.read(min(self._remaining, _READ_SIZE) if framing == _LENGTH else _READ_SIZE)
            if framing == _UNTIL_CLOSE:
                if not data:
                    self._finish()
                return data
            if not data:
                raise ConnectionLost("closed inside the body")
            self._remaining -= len(data)
            if not self._remaining:
                self._finish()
            return data
        except _FAILURES as exc:
            self._conn.discard(reader)
            raise _translated(exc) from None

    def _finish(self) -> None:
        self._framing = _NO_BODY
        self._conn.release(self._reader, self._reusable)


async def _read_head(reader: asyncio.StreamReader, conn: Connection) -> Response:
    while True:
        block = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = block[:-4].split(b"\r\n")
        version, _, rest = status_line.partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise BadResponse("not an HTTP/1.x status line")
        status = int(code)
        if status == 101:
            raise BadResponse("protocol switch")
        if status >= 200:
            break  # 1xx answers are interim: the final one follows
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon:
            raise BadResponse("header line without a colon")
        key = name.strip().lower().decode("latin-1")
        text = value.strip().decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return Response(conn, reader, status, headers, http10=version == b"HTTP/1.0")
