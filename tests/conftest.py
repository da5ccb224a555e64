"""Fixtures: a migrated template database, a fresh database per test, real uvicorn servers (one per
test, or one per module in hosted mode with a tenant per test)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import uvicorn

from service.app import create_app
from service.config import Settings
from service.http_server import server_config
from service.store import migrate
from tests.issuer import LocalIssuer

ACCEPT_BOTH = "application/json, text/event-stream"
FAULTS = Path(__file__).resolve().parent / "faults"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/faults (minutes of real replicas, haproxy and kills) runs in `make faults`, not in
    `make test`: it is collected only when a path inside it is named on the command line."""
    if collection_path != FAULTS:
        return None
    named = (Path(arg.split("::")[0]).resolve() for arg in config.args)
    return not any(p == FAULTS or FAULTS in p.parents for p in named)


def _admin_dsn() -> Iterator[str]:
    """MCP_TASKS_TEST_DATABASE_URL, else the local server on 5432, else an embedded one."""
    url = os.environ.get("MCP_TASKS_TEST_DATABASE_URL")
    if url:
        yield url
        return
    with socket.socket() as s:
        s.settimeout(0.5)
        reachable = s.connect_ex(("127.0.0.1", 5432)) == 0
    if reachable:
        yield "postgresql://postgres@127.0.0.1:5432/postgres"
        return
    from service.store.embedded import start_embedded

    with tempfile.TemporaryDirectory(prefix="mcp-tasks-test-", dir="/var/tmp") as tmp:
        yield start_embedded(Path(tmp))


def _with_db(dsn: str, name: str) -> str:
    base, _, query = dsn.partition("?")
    base = base.rsplit("/", 1)[0] + "/" + name
    return f"{base}?{query}" if query else base


@pytest.fixture(scope="session")
def admin_dsn() -> Iterator[str]:
    yield from _admin_dsn()


@pytest.fixture(scope="session")
async def template_db(admin_dsn: str) -> AsyncIterator[str]:
    name = f"mcp_tasks_tpl_{os.getpid()}_{secrets.token_hex(3)}"
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
        await asyncio.to_thread(migrate.upgrade, _with_db(admin_dsn, name))
        yield name
    finally:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()


@contextlib.asynccontextmanager
async def fresh_database(admin_dsn: str, template_db: str) -> AsyncIterator[str]:
    """A fresh, migrated database, dropped afterwards."""
    name = f"mcp_tasks_t_{secrets.token_hex(6)}"
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
        yield _with_db(admin_dsn, name)
    finally:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()


@pytest.fixture
async def database_url(admin_dsn: str, template_db: str) -> AsyncIterator[str]:
    """A fresh, migrated database for one test."""
    async with fresh_database(admin_dsn, template_db) as url:
        yield url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def listening_socket() -> socket.socket:
    """A loopback socket on a free port for uvicorn's ``sockets=``. Created as IPPROTO_TCP, not
    ``socket.socket()``'s proto 0: asyncio sets TCP_NODELAY only on sockets it knows are TCP, and
    without it every keep-alive response waits ~40 ms for the client's delayed ACK (Nagle)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    return sock


def make_settings(database_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": database_url,
        "host": "127.0.0.1",
        "port": 0,
        "poll_interval_ms": 100,
        "sweep_interval_ms": 200,
        "lease_ms": 3_000,
        # Tests stop servers with tasks still running: no drain to wait out (the drain tests set it).
        "shutdown_grace_s": 0,
        "tools": "service.tools.demo,tests.toolpack",
        "db_pool_size": 5,
        # Generous: most tests are not about the guardrails, which have tests of their own.
        "max_active_tasks_per_requestor": 1_000,
        "max_active_tasks_per_tenant": 10_000,
        "rate_limit": "100000/minute",
        "rate_limit_unauthenticated": "100000/minute",
        "rate_limit_not_found": "100000/minute",
    }
    values.update(overrides)
    return Settings(**values)


@dataclass
class RunningServer:
    url: str
    settings: Settings
    app: Any
    token: str | None = None  # a tenant_server's bearer token for this test's own tenant

    @property
    def auth(self) -> dict[str, str]:
        """The Authorization header of ``token``, if any, for requests made without an RpcSession."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


class PromptServer(uvicorn.Server):
    """A uvicorn.Server that starts shutting down as soon as ``stop()`` is called: uvicorn's main
    loop looks at should_exit only every 0.1 s, which every test server paid on its way out."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self.should_exit = True
        self._stop.set()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):  # on_tick: the Date header, max requests, should_exit
            counter = (counter + 1) % 864_000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=0.1)


@contextlib.asynccontextmanager
async def serve(settings: Settings, *, ours: bool = True) -> AsyncIterator[RunningServer]:
    """Serve create_app(settings) with uvicorn on a free loopback port in this event loop.
    ``ours=False``: uvicorn as it comes, the app under any ASGI server (no ``mcp.direct``)."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    settings = settings.model_copy(update={"port": port})
    app = create_app(settings)
    # As `mcp-tasks serve` configures it (service/http_server.py), with the tests' logging.
    options: dict[str, Any] = {"lifespan": "on", "log_level": "warning", "timeout_graceful_shutdown": 2}
    config = server_config(app, settings, **options) if ours else uvicorn.Config(app, ws="none", **options)
    server = PromptServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(30):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.02)
        yield RunningServer(f"http://127.0.0.1:{port}/mcp", settings, app)
    finally:
        server.stop()
        await task
        sock.close()


@contextlib.asynccontextmanager
async def run_issuer(issuer: LocalIssuer) -> AsyncIterator[LocalIssuer]:
    """Serve a LocalIssuer (metadata, JWKS, introspection) on a free loopback port in this loop."""
    sock = listening_socket()
    issuer.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    # A short grace: a test that made the issuer slow must not wait out its delay when stopping it.
    config = uvicorn.Config(issuer.app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=0.5)
    server = PromptServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.02)
    try:
        yield issuer
    finally:
        server.stop()
        await task
        sock.close()


@pytest.fixture(scope="module")
async def shared_issuer() -> AsyncIterator[LocalIssuer]:
    async with run_issuer(LocalIssuer()) as issuer:
        yield issuer


@pytest.fixture(scope="module")
async def shared_server(admin_dsn: str, template_db: str, shared_issuer: LocalIssuer) -> AsyncIterator[RunningServer]:
    """One hosted-mode server and database for a whole module; see ``tenant_server``."""
    async with fresh_database(admin_dsn, template_db) as url:
        # Many tests leave a task running (hang, long sleeps); they must not use up the slots.
        settings = make_settings(url, auth="oauth", oauth_issuer=shared_issuer.url, runner_concurrency=1_000)
        async with serve(settings) as running:
            yield running


@pytest.fixture
def tenant_server(shared_server: RunningServer, shared_issuer: LocalIssuer) -> RunningServer:
    """The module's shared server, seen by a tenant of this test's own: in hosted mode every task,
    session and list is scoped to the principal, so tests sharing a server cannot see each other.
    Tests that change settings, stop processes or read metrics or whole tables keep their own."""
    tenant = f"t-{secrets.token_hex(6)}"
    token = shared_issuer.mint(shared_server.url, tenant_id=tenant, sub="alice")
    return RunningServer(shared_server.url, shared_server.settings, shared_server.app, token)


@pytest.fixture
async def server(database_url: str) -> AsyncIterator[RunningServer]:
    async with serve(make_settings(database_url)) as running:
        yield running


# The server closes a keep-alive connection idle for MCP_TASKS_HTTP_KEEPALIVE_TIMEOUT_S (5 s by
# default) and httpx reuses one idle for up to its keepalive_expiry, also 5 s by default: a request
# sent just as the server closes its connection fails with ReadError (CI saw it once, in a fencing
# test that waits about 5 s between two requests). Tests' clients give an idle connection up well
# before the server would close it.
KEEPALIVE_EXPIRY_S = 1.0


def http_client(timeout: float | httpx.Timeout = 30.0, max_connections: int = 100) -> httpx.AsyncClient:
    """An httpx client for the tests: never reuses a connection the server may be closing."""
    limits = httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with http_client() as client:
        yield client
