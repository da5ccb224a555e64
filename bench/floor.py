"""The floor: a bare Starlette app answering MCP-shaped JSON-RPC with fixed results, no state.

It speaks just enough of Streamable HTTP (initialize with a session header, 202 for
notifications, JSON answers) for the load generator's `plain` workload, so the ratio of a real
server to it shows what that server spends beyond parsing and answering JSON over HTTP.
"""

from __future__ import annotations

import sys

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

INIT = {
    "protocolVersion": "2025-11-25",
    "capabilities": {"tools": {}},
    "serverInfo": {"name": "floor", "version": "0"},
}
CALL = {"content": [{"type": "text", "text": "x"}]}


async def mcp(request: Request) -> Response:
    message = orjson.loads(await request.body())
    if "id" not in message:
        return Response(status_code=202)
    result = INIT if message.get("method") == "initialize" else CALL
    body = orjson.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result})
    return Response(body, media_type="application/json", headers={"mcp-session-id": "floor"})


app = Starlette(routes=[Route("/mcp", mcp, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
