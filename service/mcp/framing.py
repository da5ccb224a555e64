"""Reading a JSON-RPC message off a POST, and telling which wire it speaks.

The body is bounded (MCP_TASKS_MAX_BODY_BYTES), must be one JSON-RPC 2.0 object (no batches,
H-GEN-3) and may not hold U+0000 (PostgreSQL cannot store it). The wire is decided from the
request alone (§14.1): ``MCP-Protocol-Version: 2026-07-28`` is the 2026-07-28 wire, anything the
2025-11-25 wire supports (or no header) the 2025-11-25 wire.
"""

from __future__ import annotations

from typing import Any, Final

import orjson
from starlette.datastructures import Headers
from starlette.types import Receive

from service.domain.task import Wire
from service.mcp import jsonrpc
from service.mcp import v2026_wire as v2026
from service.mcp.jsonrpc import INVALID_PARAMS, PARSE_ERROR
from service.mcp.refusal import Refusal, http_refusal
from service.mcp.v2025 import SUPPORTED_VERSIONS

VERSION_HEADER: Final = "mcp-protocol-version"
JSON: Final = "application/json"
EVENT_STREAM: Final = "text/event-stream"
MAX_DEPTH: Final = 64  # levels of arrays and objects in one message (decisions.md)

_ACCEPTS: dict[tuple[str, str], bool] = {}


def accepts(accept: str, media: str) -> bool:
    """Does an Accept header admit ``media``? Remembered per header value: clients send the same
    few values on every request (a bounded table; it starts afresh when full)."""
    known = _ACCEPTS.get((accept, media))
    if known is not None:
        return known
    kinds = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    major = media.split("/", 1)[0]
    answer = media in kinds or "*/*" in kinds or f"{major}/*" in kinds
    if len(_ACCEPTS) >= 1024:
        _ACCEPTS.clear()
    _ACCEPTS[(accept, media)] = answer
    return answer


def _has_nul(value: Any) -> bool:
    """Any string in the document holds U+0000? Iterative: a deeply nested body (orjson accepts
    1024 levels) must not exhaust Python's recursion limit."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _deeper_than(value: Any, most: int) -> bool:
    """Do arrays and objects nest more than ``most`` levels? Iterative, as _has_nul."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > most:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


async def _read_body(receive: Receive, headers: Headers, limit: int) -> bytes:
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise http_refusal(413, f"request body over {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise http_refusal(400, "client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise http_refusal(413, f"request body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def read_message(receive: Receive, headers: Headers, *, max_body_bytes: int) -> dict[str, Any]:
    """The POST's JSON-RPC message, or a refusal saying what is wrong with it (H-POST-1, H-POST-3)."""
    content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != JSON:
        raise http_refusal(415, "Content-Type must be application/json")
    accept = headers.get("accept", "")
    if not (accepts(accept, JSON) and accepts(accept, EVENT_STREAM)):
        raise http_refusal(406, "Not Acceptable: Accept must list application/json and text/event-stream")
    body = await _read_body(receive, headers, max_body_bytes)
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError as exc:  # (orjson says what and where: "depth limit exceeded: line 1 ...")
        raise http_refusal(400, f"Parse error: the body is not valid UTF-8 JSON ({str(exc)[:120]})",
                           code=PARSE_ERROR) from None  # fmt: skip
    # Stored and sent on as JSON (orjson writes at most 254 levels): refused here, not deep inside.
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _deeper_than(message, MAX_DEPTH):
        deep = f"the message nests deeper than {MAX_DEPTH} levels"
        if isinstance(message, dict) and "method" in message and jsonrpc.valid_id(message.get("id")):
            raise Refusal(INVALID_PARAMS, deep, request_id=message["id"])
        raise http_refusal(400, deep)
    # PostgreSQL cannot store U+0000; refused here rather than deep inside (cheap pre-check first).
    if b"\\u0000" in body and _has_nul(message):
        nul = "strings must not contain the NUL character (U+0000)"
        if isinstance(message, dict) and "method" in message and jsonrpc.valid_id(message.get("id")):
            raise Refusal(INVALID_PARAMS, nul, request_id=message["id"])
        raise http_refusal(400, nul)
    if isinstance(message, list):
        raise http_refusal(400, "Invalid Request: batches are not supported (H-GEN-3)")
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        raise http_refusal(400, 'Invalid Request: expected a JSON-RPC 2.0 object with "jsonrpc": "2.0"')
    return message


def wire_of(headers: Headers, message: dict[str, Any]) -> Wire:
    """§14.1: which wire serves this request, decided from it alone."""
    value = headers.get(VERSION_HEADER)
    if len(headers.getlist(VERSION_HEADER)) > 1:  # a proxy reading the other copy would pick another wire
        raise Refusal(v2026.HEADER_MISMATCH, "Header duplicated: MCP-Protocol-Version (send it once)", status=400,
                      request_id=message.get("id") if jsonrpc.valid_id(message.get("id")) else None)  # fmt: skip
    if value == v2026.VERSION:
        return Wire.V2026  # initialize too: it does not exist on 2026-07-28 (404)
    if message.get("method") == "initialize":
        return Wire.V2025
    request_id = message.get("id") if jsonrpc.valid_id(message.get("id")) else None
    if value is None:
        params = message.get("params")
        meta = params.get("_meta") if isinstance(params, dict) else None
        if isinstance(meta, dict) and v2026.META_VERSION in meta:
            raise Refusal(v2026.HEADER_MISMATCH, "Header mismatch: 2026-07-28 requests carry MCP-Protocol-Version",
                          status=400, request_id=request_id)  # fmt: skip
        return Wire.V2025  # a session's request from a client that sends no header (as before)
    if value in SUPPORTED_VERSIONS:
        return Wire.V2025
    supported = [v2026.VERSION, "2025-11-25"]  # as server/discover lists them
    raise Refusal(v2026.UNSUPPORTED_VERSION, f"Unsupported protocol version {value!r}; supported: {', '.join(supported)}",
                  {"supported": supported, "requested": value}, status=400, request_id=request_id)  # fmt: skip


def check_client_data(what: str, value: Any, limit: int) -> None:
    """Issue 14 §4: what the client declares about itself is kept (capabilities, clientInfo), so
    its size is bounded; over the limit is a -32602 naming the limit."""
    if value is None:
        return
    try:
        size = len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):  # pragma: no cover - parsed JSON always encodes
        size = limit + 1
    if size > limit:
        raise Refusal(INVALID_PARAMS, f"{what} is {size} bytes encoded, more than this server keeps ({limit})",
                      {"limit": limit})  # fmt: skip
