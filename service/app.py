"""create_app(settings): the ASGI application; its lifespan opens and closes every resource."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from service import __version__
from service.auth.base import Authenticator, build_authenticator
from service.auth.resource import PRM_PATH, protected_resource_metadata
from service.config import Settings
from service.core import Core, open_core
from service.guard.ratelimit import RateLimiter
from service.mcp.endpoint import McpEndpoint
from service.mcp.http import send_json
from service.mcp.plain import Inflight
from service.mcp.sse import StreamsClosing
from service.mcp.v2025 import V2025Surface
from service.mcp.v2025_http import V2025Http
from service.mcp.v2026 import V2026Surface
from service.observability import metrics, tracing
from service.observability.endpoint import MetricsEndpoint
from service.store import migrate
from service.tasks.audit import AuditLog

# How long /readyz waits for the database before it answers 503.
READY_TIMEOUT_S = 2.0


class _LateMcp:
    """Routes /mcp to the endpoint the lifespan builds (the app object exists before it)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint: McpEndpoint | None = getattr(self.app.state, "mcp", None)
        if endpoint is None:
            await send_json(send, 503, {"error": "starting up"}, {"Retry-After": "1"})
            return
        await endpoint(scope, receive, send)


class _App(FastAPI):
    """FastAPI for the small routes; /mcp goes straight to its endpoint. The endpoint handles its
    own errors, so the framework's middleware layers would only add cost to every MCP request."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/mcp":
            endpoint: McpEndpoint | None = getattr(self.state, "mcp", None)
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def begin_shutdown(app: FastAPI) -> None:
    """A shutdown has begun (SIGTERM): readiness goes false, runners claim nothing more, open
    subscriptions end with their closing result. Safe to call from a signal handler."""
    streams: StreamsClosing | None = getattr(app.state, "streams", None)
    core: Core | None = getattr(app.state, "core", None)
    loop: asyncio.AbstractEventLoop | None = getattr(app.state, "loop", None)
    if loop is None:
        return
    if streams is not None and core is not None:
        loop.call_soon_threadsafe(streams.begin, core.settings.graceful_timeout_s)
    if core is not None:
        loop.call_soon_threadsafe(core.begin_drain, core.settings.shutdown_grace_s)


def _endpoint(
    settings: Settings, core: Core, authenticator: Authenticator, limiter: RateLimiter, audit: AuditLog,
    streams: StreamsClosing,
) -> tuple[McpEndpoint, V2026Surface]:  # fmt: skip
    """The MCP endpoint and its two wires, whose open streams end as ``streams`` says."""
    v2025 = V2025Surface(
        core.tasks, core.sessions, core.registry, Inflight(core.signals), limiter, audit,
        poll_s=settings.poll_interval_ms / 1000, result_grace_s=settings.result_grace_ms / 1000,
    )  # fmt: skip
    v2026 = V2026Surface(settings, core.tasks, v2025, limiter, audit, streams)
    endpoint = McpEndpoint(settings, authenticator, limiter, audit,
                           V2025Http(settings, core.sessions, core.tasks, v2025, streams), v2026)  # fmt: skip
    return endpoint, v2026


def create_app(settings: Settings, *, run_tasks: bool = True) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Outbound HTTP (JWKS, discovery, introspection): short timeouts, no redirects to elsewhere.
        tracing.configure("serve")  # on only with an OTLP endpoint set (OTEL_EXPORTER_OTLP_ENDPOINT)
        http = httpx.AsyncClient(timeout=settings.oauth_http_timeout_s, follow_redirects=False)
        authenticator = build_authenticator(settings, http)
        core = await open_core(settings, run_tasks=run_tasks)
        limiter = RateLimiter(settings, on_storage_error=metrics.rate_limit_storage_errors.inc)
        audit = AuditLog(core.db, on_write_failure=metrics.audit_write_failures.inc)
        app.state.core = core
        app.state.streams = streams = StreamsClosing()
        app.state.mcp, app.state.v2026 = _endpoint(settings, core, authenticator, limiter, audit, streams)
        app.state.loop = asyncio.get_running_loop()
        metrics_endpoint = None
        if settings.metrics_port:
            metrics_endpoint = MetricsEndpoint(settings.host, settings.metrics_port, lambda: readiness(core))
            await metrics_endpoint.start()
        try:
            yield
        finally:
            streams.end_now()
            app.state.mcp = None
            if metrics_endpoint is not None:
                await metrics_endpoint.close()
            await core.close()
            await http.aclose()
            tracing.shutdown()

    # No OpenAPI document: /mcp is not described by it, and it answered any Host.
    app = _App(
        title="mcp-task-service",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.router.routes.append(Route("/mcp", endpoint=_LateMcp(app)))
    metrics.configure(
        tenant_label=settings.metrics_tenant_label, tenant_limit=settings.metrics_tenant_limit, version=__version__
    )

    if not settings.metrics_port:  # else /metrics is on its own port only (MetricsEndpoint)

        @app.get("/metrics", include_in_schema=False)
        async def prometheus_metrics(request: Request) -> Response:
            # On the /mcp port, the same Host rule as /mcp (DNS rebinding); a scraper that cannot
            # send an allowed Host uses MCP_TASKS_METRICS_PORT, which serves nothing else.
            endpoint: McpEndpoint | None = getattr(app.state, "mcp", None)
            if endpoint is not None and not endpoint.guard.host_allowed(request.headers.get("host", "")):
                return JSONResponse(
                    {"error": "Host is not served here; scrape MCP_TASKS_METRICS_PORT"}, status_code=403
                )
            body, content_type = metrics.exposition(request.headers.get("accept", ""))
            return Response(body, media_type=content_type)

    if settings.effective_auth == "oauth":
        metadata = protected_resource_metadata(settings)
        path = urlsplit(settings.effective_public_url).path.rstrip("/")

        async def resource_metadata() -> dict[str, Any]:
            return metadata

        # RFC 9728: the root form and the path-inserted form of the MCP endpoint (A-PRM-3/4).
        for route in dict.fromkeys([PRM_PATH, PRM_PATH + path]):
            app.add_api_route(route, resource_metadata, methods=["GET"])

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        status, body = await readiness(getattr(app.state, "core", None))
        return JSONResponse(body, status_code=status)

    return app


async def readiness(core: Core | None) -> tuple[int, dict[str, Any]]:
    """/readyz (on the /mcp port and the metrics port): the database answers and its schema is at head."""
    status, body = await _check_ready(core)
    metrics.ready.labels("readyz").set(1 if status == 200 else 0)
    return status, body


async def _check_ready(core: Core | None) -> tuple[int, dict[str, Any]]:
    if core is None:
        return 503, {"status": "starting"}
    if core.drain_deadline is not None:
        return 503, {"status": "draining"}  # a load balancer sends new work elsewhere
    try:
        # Bounded: with packets dropped the driver would wait out its command timeout (60 s), and a
        # probe that gets no answer tells the orchestrator less than a 503 that says why.
        current = await asyncio.wait_for(
            core.db.fetchval("SELECT version_num FROM alembic_version"), timeout=READY_TIMEOUT_S
        )
    except TimeoutError:
        return 503, {"status": "database unreachable", "detail": f"no answer within {READY_TIMEOUT_S:g} s"}
    except Exception:
        return 503, {"status": "database unreachable"}
    head = migrate.head_revision()
    if not migrate.schema_fits(current):
        return 503, {"status": "migrations pending", "current": current, "head": head}
    return 200, {"status": "ready", "revision": current, "head": head, "listening": core.hub.connected}
