"""A request of the 2026-07-28 wire as its handlers see it, and the small readers they share."""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator
from typing import Any, Final

from starlette.datastructures import Headers
from starlette.types import Scope

from service.domain.principal import Caller
from service.domain.values import frozen
from service.mcp import v2026_wire as ext
from service.mcp.jsonrpc import INVALID_PARAMS, RequestId
from service.mcp.refusal import Refusal

METHOD_HEADER: Final = "mcp-method"
RESOURCE_NOT_FOUND: Final = -32002
NAME_HEADER: Final = "mcp-name"
ROUTING_HEADERS: Final = frozenset({b"mcp-protocol-version", b"mcp-method", b"mcp-name"})
TASK_METHODS: Final = frozenset({"tasks/get", "tasks/update", "tasks/cancel"})
LOOKUPS: Final = frozenset({"tasks/get", "tasks/update", "tasks/cancel"})
# Methods whose Mcp-Name names a parameter: (the parameter, whether the header is required).
NAMED: Final = {"tools/call": ("name", True), "prompts/get": ("name", False), "resources/read": ("uri", False)}
# Cache hints of list and read results (2026-07-28 caching): the registry is fixed per process.
CACHE_HINT: Final = {"ttlMs": 60_000, "cacheScope": "private"}
# The 2026-07-28 codes answered with HTTP 400 (§11), whoever raises them (a tool may, too).
HTTP_400_CODES: Final = frozenset({ext.HEADER_MISMATCH, ext.MISSING_CAPABILITY, ext.UNSUPPORTED_VERSION})


def fail(code: int, message: str, data: Any = None, *, status: int = 200) -> Refusal:
    return Refusal(code, message, data, status=status)


def header_value(raw: str | None) -> str | None:
    """X-HTTP-2: ``=?base64?<b64>?=`` is Base64 of the UTF-8 value."""
    if raw is None or not (raw.startswith("=?base64?") and raw.endswith("?=")):
        return raw
    try:
        return base64.b64decode(raw[9:-2], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise fail(ext.HEADER_MISMATCH, "Mcp-Name is not valid =?base64?...?= text", status=400) from None


def object_param(params: dict[str, Any], name: str, *, required: bool = False) -> dict[str, Any] | None:
    value = params.get(name)
    if value is None:
        if required:
            raise fail(INVALID_PARAMS, f"missing params.{name}")
        return None
    if not isinstance(value, dict):
        raise fail(INVALID_PARAMS, f"params.{name} must be an object")
    return value


def string_param(params: dict[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str):
        raise fail(INVALID_PARAMS, f"params.{name} must be a string" if name in params else f"missing params.{name}")
    return value


@frozen
class V2026Call:
    caller: Caller
    request_id: RequestId
    method: str
    params: dict[str, Any]
    capabilities: dict[str, Any]
    headers: Headers
    scope: Scope

    @property
    def declaring(self) -> bool:
        """The request declares the Tasks extension (X-NEG-4, X-NEG-8: a legacy ``tasks`` key does not)."""
        extensions = self.capabilities.get("extensions")
        return isinstance(extensions, dict) and isinstance(extensions.get(ext.EXTENSION), dict)

    def require_declaring(self) -> None:
        if not self.declaring:
            raise fail(
                ext.MISSING_CAPABILITY,
                f"{self.method} needs the {ext.EXTENSION} extension: declare it in "
                f"_meta[{ext.META_CAPABILITIES!r}].extensions",
                {"requiredCapabilities": ext.REQUIRED_CAPABILITIES},
                status=400,
            )


@frozen
class Streamed:
    """An answer sent as SSE: notifications, then the response."""

    messages: AsyncIterator[dict[str, Any]]


def duplicated_routing_header(headers: Headers) -> str | None:
    """The first routing header (MCP-Protocol-Version, Mcp-Method, Mcp-Name, Mcp-Param-*) sent more
    than once, if any: a proxy that reads another copy than ours would route elsewhere."""
    seen: set[bytes] = set()
    for key, _ in headers.raw:
        if key in ROUTING_HEADERS or key.startswith(b"mcp-param-"):
            if key in seen:
                return key.decode("latin-1")
            seen.add(key)
    return None
