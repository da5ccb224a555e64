"""Shared helpers of the attack tests (`make security`): raw loopback sockets, nothing more."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


@contextlib.asynccontextmanager
async def raw_socket(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A plain TCP connection to the server of ``url``, closed on exit; the test writes the bytes."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection; fails if it is still open
    after ``timeout_s``."""
    chunks = []
    async with asyncio.timeout(timeout_s):
        with contextlib.suppress(ConnectionResetError):  # a close with unread input is a reset
            while chunk := await reader.read(65_536):
                chunks.append(chunk)
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP/1.1 response."""
    return int(response.split(b" ", 2)[1])
