"""An upstream MCP server that speaks only 2026-07-28, for the tests: ``server/discover``,
``tools/list`` and ``tools/call`` (``echo``, and ``grow``, which adds the tool ``grown``), answered
as JSON, and ``subscriptions/listen``, an SSE stream that says when the tools changed
(``toolsListChanged``); ``initialize`` (the 2025-11-25 handshake) is refused with an error naming
the version it speaks, as a server does once its legacy front end is off (XD-24). No Tasks
extension: its calls are answered at once.

    python -m tests.modern_only_server PORT [--marks DIR]

``--marks DIR``: each request writes a line ``<method> <MCP-Protocol-Version header or ->`` to
``DIR/requests``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

PROTOCOL = "2026-07-28"
parser = argparse.ArgumentParser()
parser.add_argument("port", type=int)
parser.add_argument("--marks", default=None)
ARGS = parser.parse_args()
MARKS = Path(ARGS.marks) if ARGS.marks else None
ECHO = {
    "name": "echo",
    "description": "Answers with its text.",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
}
GROW = {"name": "grow", "description": "Adds the tool grown.", "inputSchema": {"type": "object"}}
GROWN = {"name": "grown", "description": "Added by grow.", "inputSchema": {"type": "object"}}
TOOLS = [ECHO, GROW]
LISTENERS: set[asyncio.Queue[None]] = set()


def result_of(method: str, params: dict[str, Any]) -> dict[str, Any]:
    if method == "server/discover":
        return {"resultType": "complete", "supportedVersions": [PROTOCOL], "capabilities": {"tools": {}},
                "ttlMs": 0, "cacheScope": "private"}  # fmt: skip
    if method == "tools/list":
        return {"resultType": "complete", "tools": TOOLS}
    if method == "tools/call" and params.get("name") == "echo":
        text = str((params.get("arguments") or {}).get("text", ""))
        return {"resultType": "complete", "content": [{"type": "text", "text": text}]}
    if method == "tools/call" and params.get("name") == "grow":
        if GROWN not in TOOLS:
            TOOLS.append(GROWN)
            for queue in LISTENERS:
                queue.put_nowait(None)
        return {"resultType": "complete", "content": [{"type": "text", "text": "grew"}]}
    raise LookupError(method)


async def listened(params: dict[str, Any]) -> AsyncIterator[bytes]:
    """The acknowledgement, then a notifications/tools/list_changed per change, until the client goes."""
    wanted = bool((params.get("notifications") or {}).get("toolsListChanged"))
    agreed = {"toolsListChanged": True} if wanted else {}
    ack = {"jsonrpc": "2.0", "method": "notifications/subscriptions/acknowledged", "params": {"notifications": agreed}}
    yield b"data: " + orjson.dumps(ack) + b"\n\n"
    queue: asyncio.Queue[None] = asyncio.Queue()
    if wanted:
        LISTENERS.add(queue)
    try:
        while True:
            await queue.get()
            changed = {"jsonrpc": "2.0", "method": "notifications/tools/list_changed", "params": {}}
            yield b"data: " + orjson.dumps(changed) + b"\n\n"
    finally:
        LISTENERS.discard(queue)


async def endpoint(request: Request) -> Response:
    message = orjson.loads(await request.body())
    method, params = message.get("method"), message.get("params") or {}
    if MARKS is not None:
        with (MARKS / "requests").open("a") as f:
            f.write(f"{method} {request.headers.get('mcp-protocol-version', '-')}\n")
    if "id" not in message:
        return Response(status_code=202)
    if method == "initialize":
        error = {"code": -32602, "message": f"Unsupported protocol version: this server speaks {PROTOCOL} only",
                 "data": {"supported": [PROTOCOL]}}  # fmt: skip
        body = {"jsonrpc": "2.0", "id": message["id"], "error": error}
        return Response(orjson.dumps(body), status_code=400, media_type="application/json")
    if method == "subscriptions/listen":
        return StreamingResponse(listened(params), media_type="text/event-stream")
    try:
        body = {"jsonrpc": "2.0", "id": message["id"], "result": result_of(method, params)}
    except LookupError:
        body = {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -32601, "message": f"no {method}"}}
    return Response(orjson.dumps(body), media_type="application/json")


def main() -> None:
    app = Starlette(routes=[Route("/mcp", endpoint=endpoint, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=ARGS.port, log_level="critical")


if __name__ == "__main__":
    main()
