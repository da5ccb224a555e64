"""``mcp-tasks tools``: the server's tools, whether each may run as a task, and its arguments."""

from __future__ import annotations

import argparse
import json
from typing import Any

from service.cli_exit import OK, CommandState, check_url
from service.client import McpClient


def add_parser(sub: Any) -> None:
    tools = sub.add_parser("tools", help="list the server's tools: task support and arguments")
    tools.add_argument("--url", default="http://127.0.0.1:8000/mcp")
    tools.add_argument("--token", default=None)
    tools.add_argument("--json", action="store_true", help="print the server's tool descriptions as JSON")
    tools.add_argument("--retry-for", type=float, default=15.0, metavar="S",
                       help="keep retrying an unavailable or unreachable server for S seconds (default 15)")  # fmt: skip


def schema_summary(schema: dict[str, Any]) -> str:
    """``name:type`` per property, required ones first and unmarked, optional ones with ``?``."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    if not isinstance(properties, dict) or not properties:
        return "(no arguments)"
    parts = []
    for name in sorted(properties, key=lambda n: (n not in required, n)):
        spec = properties[name] if isinstance(properties[name], dict) else {}
        kind = spec.get("type", "any")
        kind = "|".join(map(str, kind)) if isinstance(kind, list) else str(kind)
        parts.append(f"{name}{'' if name in required else '?'}:{kind}")
    return " ".join(parts)


async def tools_main(args: argparse.Namespace, state: CommandState) -> int:
    """tools/list on 2025-11-25, whose tool descriptions carry ``execution.taskSupport``."""
    check_url(args.url)
    tools: list[dict[str, Any]] = []
    async with McpClient(args.url, token=args.token) as client:
        await client.initialize(retry_for_s=args.retry_for)
        cursor = None
        while True:
            page = await client.request("tools/list", {"cursor": cursor} if cursor else {}, retry_for_s=args.retry_for)
            tools.extend(t for t in page.get("tools", []) if isinstance(t, dict))
            cursor = page.get("nextCursor")
            if not cursor:
                break
    if args.json:
        print(json.dumps({"tools": tools}, indent=2))
        return OK
    width = max((len(str(t.get("name", ""))) for t in tools), default=4)
    print(f"{'TOOL':<{width}}  {'TASK':<9}  ARGUMENTS")
    for tool in sorted(tools, key=lambda t: str(t.get("name", ""))):
        support = (tool.get("execution") or {}).get("taskSupport", "forbidden")
        print(f"{tool.get('name', ''):<{width}}  {support:<9}  {schema_summary(tool.get('inputSchema') or {})}")
    return OK
