"""Fixtures for the attacks of issue 14 (`make security`): raw loopback sockets; a database migrated
the way production is (so its database-level grants hold, which a copy of the test template would
not keep), a login user set up as docs/operations.md says (a member of the service's roles, nothing
else), and a stranger: a login role with no grants at all."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from service.store import migrate
from service.store.db import APP_ROLE, EXPORTER_ROLE, RUNNER_ROLE
from tests.conftest import _with_db


def as_user(url: str, user: str) -> str:
    """``url`` for another login role, without a password (the test server trusts loopback)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


@contextlib.asynccontextmanager
async def owned_by_a_non_superuser(admin_dsn: str) -> AsyncIterator[tuple[str, str, str]]:
    """A database migrated as docs/operations.md says: by its owner, a CREATEROLE login that is not
    a superuser. Yields the superuser's URL of it, the owner's URL and the owner; both go on exit."""
    tag = secrets.token_hex(4)
    owner, name = f"mcp_tasks_owner_{tag}", f"mcp_tasks_own_{tag}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f"CREATE ROLE {owner} LOGIN CREATEROLE")
        await admin.execute(f'CREATE DATABASE "{name}" OWNER {owner}')
        url = _with_db(admin_dsn, name)
        await asyncio.to_thread(migrate.upgrade, as_user(url, owner))
        yield url, as_user(url, owner), owner
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f"DROP OWNED BY {owner}")
        await admin.execute(f"DROP ROLE IF EXISTS {owner}")
        await admin.close()


@dataclass(frozen=True)
class ClosedDatabase:
    admin_url: str  # the migration user (a superuser here): the schema's owner
    service_url: str  # the service's login user: a member of mcp_tasks_app and mcp_tasks_runner
    stranger_url: str  # a login role with no grants
    exporter_url: str  # the export path's login: a member of mcp_tasks_exporter only

    async def connect_as(self, role: str | None) -> asyncpg.Connection:
        """A connection of the service's login user acting as ``role``, as the service's pools do."""
        return await asyncpg.connect(self.service_url, server_settings={"role": role} if role else {})


@pytest.fixture(scope="module")
async def closed_db(admin_dsn: str) -> AsyncIterator[ClosedDatabase]:
    tag = secrets.token_hex(4)
    name, service, stranger = f"mcp_tasks_sec_{tag}", f"mcp_tasks_svc_{tag}", f"mcp_tasks_stranger_{tag}"
    exporter = f"mcp_tasks_export_{tag}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        for role in (service, stranger, exporter):
            await admin.execute(f"CREATE ROLE {role} LOGIN")
        url = _with_db(admin_dsn, name)
        await asyncio.to_thread(migrate.upgrade, url)
        await admin.execute(f"GRANT {APP_ROLE}, {RUNNER_ROLE} TO {service}")
        await admin.execute(f"GRANT {EXPORTER_ROLE} TO {exporter}")
        yield ClosedDatabase(url, as_user(url, service), as_user(url, stranger), as_user(url, exporter))
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        for role in (service, stranger, exporter):
            await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


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


async def trickle(
    writer: asyncio.StreamWriter, closed: asyncio.Future[bytes], data: bytes, every_s: float = 0.05
) -> None:
    """Send ``data`` a byte every ``every_s`` (a slowloris client) until it is sent or ``closed``
    (a read_until_closed of the same socket) is done; the server closing the socket ends it too."""
    with contextlib.suppress(OSError):
        for byte in data:
            if closed.done():
                return
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(every_s)
