"""Traces with the OpenTelemetry SDK (issue 44; README, "Tracing"), off unless an OTLP endpoint is set.

Configured by the standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*``, ...), read by the SDK itself; the sampler defaults to
parent-based 10 %. With no endpoint nothing of OpenTelemetry is imported and every function here
is a check of one attribute: the hot path pays nothing.

What is traced: a server span per MCP request (the MCP semantic conventions: ``{mcp.method.name}
{target}``, parented by ``params._meta.traceparent``, the HTTP ``traceparent`` a link); a task's
run is a child of the request that created it (its ``traceparent`` is stored with the task), in
whichever process runs it, with its changes as events; later requests about a task link to it;
each group-committed batch is a span linked to the requests it carries; outgoing calls are client
spans that propagate ``traceparent``.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

log = logging.getLogger(__name__)

DEFAULT_RATIO: Final = 0.1  # the default sampler: parent-based, 10 % of new traces
TENANT_ATTRIBUTE: Final = "mcp_tasks.tenant.id"
TASK_ATTRIBUTE: Final = "mcp_tasks.task.id_prefix"  # a task id is a bearer handle: 8 characters only
NO_SPAN: Final[contextlib.AbstractContextManager[Any]] = contextlib.nullcontext(None)


class _On:
    """The SDK's pieces while tracing is on (all None while it is off)."""

    tracer: Any = None
    provider: Any = None
    api: Any = None  # the opentelemetry.trace module
    propagator: Any = None
    context: Any = None  # the opentelemetry.context module
    span_kind: Any = None
    link: Any = None
    status_error: Any = None
    # The default sampler's root decision, taken here (None: a sampler the operator chose decides
    # everything in the SDK). A root not sampled then costs a context of its own, no SDK span.
    root_ratio: float | None = None


_on = _On()


def enabled() -> bool:
    return _on.tracer is not None


def configure(component: str, environ: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on when an OTLP endpoint is set (and the SDK is installed); True when on."""
    env = os.environ if environ is None else environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    if enabled() or not endpoint or disabled or env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return enabled()
    try:
        from opentelemetry import context, trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed: install "
                    "mcp-task-service[tracing] (the image has it); tracing stays off")  # fmt: skip
        return False
    from service import __version__

    attributes: dict[str, str] = {"service.version": __version__, "mcp_tasks.component": component}
    if not env.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "mcp-task-service"
    # The default, parent-based 10 %: the SDK follows parents; roots are drawn here (_root), and
    # reach the SDK only when sampled. An operator's OTEL_TRACES_SAMPLER decides everything itself.
    own_roots = not env.get("OTEL_TRACES_SAMPLER")
    sampler = ParentBased(ALWAYS_ON) if own_roots else None
    _on.root_ratio = DEFAULT_RATIO if own_roots else None
    provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _on.provider = provider
    _on.tracer = provider.get_tracer("mcp-task-service", __version__)
    _on.api, _on.context = trace, context
    _on.propagator = TraceContextTextMapPropagator()
    _on.span_kind, _on.link, _on.status_error = trace.SpanKind, trace.Link, trace.StatusCode.ERROR
    log.info("tracing on: spans go to %s over OTLP/HTTP", endpoint)
    return True


def shutdown() -> None:
    """Export what is still buffered (at the end of the process)."""
    if _on.provider is not None:
        _on.provider.shutdown()
    _on.tracer = _on.provider = None


def _context_of(carrier: Mapping[str, Any] | None) -> Any:
    """The remote span context a W3C ``traceparent`` (and ``tracestate``) in ``carrier`` names, or None."""
    if not carrier:
        return None
    traceparent = carrier.get("traceparent")
    if not isinstance(traceparent, str) or len(traceparent) > 128:
        return None
    fields = {"traceparent": traceparent}
    if isinstance(state := carrier.get("tracestate"), str) and len(state) <= 512:
        fields["tracestate"] = state
    ctx = _on.propagator.extract(fields)
    span_context = _on.api.get_current_span(ctx).get_span_context()
    return ctx if span_context.is_valid else None


def session_hash(session_id: str) -> str:
    """What a span records of a session id (itself a handle): the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:16]


# The current span when it is not recorded: (trace id, span id). Such a span costs this one
# variable, not the SDK's objects and context (they were about 16 % of a lifecycle's instructions,
# bench/instructions.py). None: the SDK's current span (if any) is the current one.
_dropped: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("mcp_tasks_dropped", default=None)


class _Dropped:
    """A span that is not recorded, current inside the block: in ``trace_id``'s trace (a new one
    when None), with a span id of its own, as the SDK's random generator makes them."""

    __slots__ = ("ids", "token")

    def __init__(self, trace_id: int | None = None) -> None:
        self.ids = (trace_id or (random.getrandbits(128) or 1), random.getrandbits(64) or 1)

    def __enter__(self) -> None:
        self.token = _dropped.set(self.ids)

    def __exit__(self, *exc: object) -> None:
        _dropped.reset(self.token)


class _Recorded:
    """A span of the SDK, current inside the block (no dropped span is, meanwhile)."""

    __slots__ = ("inner", "token")

    def __init__(self, inner: contextlib.AbstractContextManager[Any]) -> None:
        self.inner = inner

    def __enter__(self) -> Any:
        self.token = _dropped.set(None)
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        try:
            return self.inner.__exit__(*exc)
        finally:
            _dropped.reset(self.token)


def _trace_id_of(traceparent: Any) -> int | None:
    """The trace id of a W3C ``traceparent`` whose flags say "not sampled" (None otherwise): under
    the default sampler what runs under it is not sampled either."""
    if not isinstance(traceparent, str) or len(traceparent) != 55 or not traceparent.endswith("-00"):
        return None
    try:
        trace_id = int(traceparent[3:35], 16)
    except ValueError:
        return None
    return trace_id or None


def _root_dropped() -> bool:
    """A new trace under the default sampler: not sampled (90 %)?"""
    return _on.root_ratio is not None and random.random() >= _on.root_ratio


def server_span(
    method: str, *, target: str | None, meta: Any, http_traceparent: str | None,
    attributes: Callable[[], dict[str, Any]],
) -> contextlib.AbstractContextManager[Any]:  # fmt: skip
    """A request's server span, current inside the block (None while tracing is off): parented by
    ``params._meta``'s trace context when the client sent one, the HTTP ``traceparent`` a link.
    ``attributes`` are read only for a span that may be recorded."""
    if _on.tracer is None:
        return NO_SPAN
    meta = meta if isinstance(meta, dict) else None
    if _on.root_ratio is not None and (trace_id := _trace_id_of(meta and meta.get("traceparent"))) is not None:
        return _Dropped(trace_id)  # the client's trace, not sampled: neither is this request
    parent = _context_of(meta)
    if parent is None and _root_dropped():
        return _Dropped()
    links = []
    if http_traceparent is not None and (http := _context_of({"traceparent": http_traceparent})) is not None:
        links.append(_on.link(_on.api.get_current_span(http).get_span_context()))
    return _Recorded(
        _on.tracer.start_as_current_span(
            f"{method} {target}" if target else method,
            context=parent if parent is not None else _on.context.Context(),
            kind=_on.span_kind.SERVER,
            attributes={
                "mcp.method.name": method,
                "network.transport": "tcp",
                "network.protocol.name": "http",
                **attributes(),
            },
            links=links,
            record_exception=False,
            set_status_on_exception=False,
        )
    )


def run_span(
    task_traceparent: str | None, name: str, attributes: Callable[[], dict[str, Any]]
) -> contextlib.AbstractContextManager[Any]:
    """A task's run, a child of the request that created the task (its stored ``traceparent``),
    in whichever process runs it; a root span when the create was not traced. A parent that was
    not sampled (flags 00) makes a run that is not either, in the same trace."""
    if _on.tracer is None:
        return NO_SPAN
    if _on.root_ratio is not None and (trace_id := _trace_id_of(task_traceparent)) is not None:
        return _Dropped(trace_id)
    parent = _context_of({"traceparent": task_traceparent}) if task_traceparent else None
    if parent is None and _root_dropped():
        return _Dropped()
    return _Recorded(
        _on.tracer.start_as_current_span(
            name,
            context=parent if parent is not None else _on.context.Context(),
            kind=_on.span_kind.CONSUMER,
            attributes=attributes(),
            record_exception=False,
            set_status_on_exception=False,
        )
    )


def client_span(name: str, attributes: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """An outgoing call's client span (a child of what is current)."""
    if _on.tracer is None:
        return NO_SPAN
    if (ids := _dropped.get()) is not None:
        return _Dropped(ids[0])
    if not _on.api.get_current_span().get_span_context().is_valid and _root_dropped():
        return _Dropped()
    return _Recorded(
        _on.tracer.start_as_current_span(
            name,
            kind=_on.span_kind.CLIENT,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )
    )


def inject(carrier: dict[str, Any]) -> None:
    """Add the current span's ``traceparent`` (and ``tracestate``) to ``carrier`` (HTTP headers, or
    an MCP request's ``_meta``)."""
    if _on.tracer is None:
        return
    if (ids := _dropped.get()) is not None:
        carrier["traceparent"] = f"00-{ids[0]:032x}-{ids[1]:016x}-00"
        return
    _on.propagator.inject(carrier)


def traceparent() -> str | None:
    """The current span's W3C ``traceparent`` (sampled or not: what runs under it follows the same
    decision), to store with a task; None while tracing is off or outside a span."""
    if _on.tracer is None:
        return None
    if (ids := _dropped.get()) is not None:
        return f"00-{ids[0]:032x}-{ids[1]:016x}-00"
    span_context = _on.api.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def event(name: str, **attributes: Any) -> None:
    """An event on the current span (a task's status change, a question, a cancel)."""
    if _on.tracer is not None and _dropped.get() is None:
        span = _on.api.get_current_span()
        if span.is_recording():
            span.add_event(name, attributes)


def set_attributes(**attributes: Any) -> None:
    """Attributes of the current span, known after it began (a session's protocol version)."""
    if _on.tracer is not None and _dropped.get() is None:
        span = _on.api.get_current_span()
        if span.is_recording():
            span.set_attributes({k.replace("__", "."): v for k, v in attributes.items() if v is not None})


def failed(error_type: str, code: int | None = None) -> None:
    """The current span ended in an error: ``error.type`` (the JSON-RPC code, or what failed)."""
    if _on.tracer is not None and _dropped.get() is None:
        span = _on.api.get_current_span()
        if span.is_recording():
            span.set_attribute("error.type", error_type)
            if code is not None:
                span.set_attribute("rpc.response.status_code", str(code))
            span.set_status(_on.status_error)


def link_task(task_traceparent: str | None) -> None:
    """A request about a task (``tasks/get``, ``tasks/result``, ``tasks/update``, ``tasks/cancel``)
    links to the task's trace."""
    if _on.tracer is not None and _dropped.get() is None and task_traceparent:
        span = _on.api.get_current_span()
        if span.is_recording() and (ctx := _context_of({"traceparent": task_traceparent})) is not None:
            span.add_link(_on.api.get_current_span(ctx).get_span_context())


def capture() -> Any:
    """The current span's context if it is sampled, to link a batch to or name in an exemplar (None
    otherwise): a batch has a span of its own when a sampled request rides on it."""
    if _on.tracer is None or _dropped.get() is not None:
        return None
    span_context = _on.api.get_current_span().get_span_context()
    return span_context if span_context.is_valid and span_context.trace_flags.sampled else None


@contextlib.contextmanager
def batch_span(name: str, carried: Sequence[Any], attributes: dict[str, Any]) -> Iterator[None]:
    """One span per group-committed batch, linked to the requests it carries."""
    if _on.tracer is None:
        yield
        return
    links = [_on.link(c) for c in carried if c is not None]
    if not links:  # nothing traced rides on it: no span of its own
        yield
        return
    with _Recorded(_on.tracer.start_as_current_span(name, context=_on.context.Context(), kind=_on.span_kind.CLIENT,
                                                    links=links, attributes=attributes)):  # fmt: skip
        yield


def current_ids() -> tuple[int, int] | None:
    """The current span's trace and span ids (recorded or not: a log line's ``trace_id`` ties the
    lines of one task's requests and runs together even where no span was kept)."""
    if _on.tracer is None:
        return None
    if (ids := _dropped.get()) is not None:
        return ids
    span_context = _on.api.get_current_span().get_span_context()
    return (span_context.trace_id, span_context.span_id) if span_context.is_valid else None


def exemplar() -> dict[str, str] | None:
    """The current sampled span's trace id, for a latency observation's exemplar."""
    if (span_context := capture()) is None:
        return None
    return {"trace_id": format(span_context.trace_id, "032x"), "span_id": format(span_context.span_id, "016x")}
