"""A real OTLP/HTTP trace receiver on a loopback port, for tests: what the service's exporters send,
decoded with the opentelemetry-proto package."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.conftest import PromptServer, listening_socket

KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


@dataclass
class Span:
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    events: list[str]
    resource: dict[str, Any] = field(default_factory=dict)


@dataclass
class OtlpReceiver:
    url: str = ""
    spans: list[Span] = field(default_factory=list)
    requests: int = 0

    async def app(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/traces":
            self.requests += 1
            self._decode(body)
        reply = ExportTraceServiceResponse().SerializeToString()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-protobuf")]})  # fmt: skip
        await send({"type": "http.response.body", "body": reply})

    def _decode(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(Span(
                        name=s.name, kind=KINDS.get(s.kind, str(s.kind)), trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        events=[e.name for e in s.events], resource=resource,
                    ))  # fmt: skip

    def named(self, prefix: str) -> list[Span]:
        return [s for s in self.spans if s.name.startswith(prefix)]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 20) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def otlp_receiver() -> AsyncIterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    sock = listening_socket()
    receiver.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(
        receiver.app, log_level="warning", lifespan="off", interface="asgi3", timeout_graceful_shutdown=0.5
    )
    server = PromptServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.02)
    try:
        yield receiver
    finally:
        server.stop()
        await task
        sock.close()


def tracing_env(receiver: OtlpReceiver, **extra: str) -> dict[str, str]:
    """What turns a subprocess's tracing on, every span kept and sent within 0.1 s."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_TRACES_SAMPLER": "always_on",
            "OTEL_BSP_SCHEDULE_DELAY": "100", **extra}  # fmt: skip
