"""A TCP proxy a test controls, to cut one process off its database (issue 13, point 2).

``cut()`` drops every connection through it at once (both ends reset) and blackholes new ones:
they are accepted and held, nothing forwarded, as a network partition holds a connection attempt;
``cut(refuse=True)`` closes new ones at once instead. ``heal()`` forwards the held ones (a client
that gave up meanwhile finds its socket closed) and lets new ones through again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class TcpProxy:
    def __init__(self, upstream_host: str = "127.0.0.1", upstream_port: int = 5432) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.connections = 0  # accepted so far, to see that the client really came through here
        self._server: asyncio.Server | None = None
        self._healed = asyncio.Event()
        self._healed.set()
        self._refuse = False
        self._links: set[asyncio.StreamWriter] = set()
        self._jobs: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def is_cut(self) -> bool:
        return not self._healed.is_set()

    def cut(self, *, refuse: bool = False) -> None:
        self._refuse = refuse
        self._healed.clear()
        for writer in list(self._links):
            writer.transport.abort()
        self._links.clear()

    def heal(self) -> None:
        self._healed.set()

    async def close(self) -> None:
        self.cut(refuse=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for job in list(self._jobs):
            job.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        job = asyncio.create_task(self._serve(reader, writer))
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.is_cut:
            if self._refuse:
                writer.transport.abort()
                return
            await self._healed.wait()  # blackholed until the cut heals
            if writer.is_closing() or reader.at_eof():
                writer.transport.abort()
                return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        if self.is_cut:  # cut while connecting
            up_writer.transport.abort()
            writer.transport.abort()
            return
        self._links.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._links.discard(writer)
            self._links.discard(up_writer)
            writer.transport.abort()
            up_writer.transport.abort()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()  # one side ended: so does the other


@contextlib.asynccontextmanager
async def tcp_proxy(upstream_host: str = "127.0.0.1", upstream_port: int = 5432) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(upstream_host, upstream_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
