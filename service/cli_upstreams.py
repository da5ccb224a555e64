"""``mcp-tasks upstreams``: each upstream MCP server of MCP_TASKS_UPSTREAMS_FILE as every live
process sees it (each follows its upstreams itself and records what it sees: upstream_states)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from service.cli_records import print_table, record_database

HEADER = ("upstream", "process", "transport", "tasks", "state", "down_since", "circuit", "tools", "last_error")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "upstreams", help="each upstream MCP server as every live process sees it: state, circuit, tools, last error"
    )
    p.add_argument("--json", action="store_const", dest="format", const="json", help="one JSON object per row")


async def upstreams_main(args: argparse.Namespace) -> int:
    from service.cli_config import load_settings
    from service.cli_exit import CommandError
    from service.store.db import RUNNER_ROLE
    from service.store.upstreams import UpstreamStates
    from service.upstream.config import load

    settings = load_settings()
    try:
        configured = [u.name for u in load(settings.upstreams_file)] if settings.upstreams_file else []
    except ValueError as exc:  # the file's UpstreamConfigError: names the upstream and the key
        raise CommandError(1, f"mcp-tasks upstreams: MCP_TASKS_UPSTREAMS_FILE: {exc}") from None
    async with record_database(RUNNER_ROLE, "upstreams") as db:
        states = await UpstreamStates(db).live()
    json_out = args.format == "json"
    rows: list[list[Any]] = []
    for s in states:
        tools: Any = s.state.get("tools", [])
        rows.append([s.upstream, s.owner, s.state.get("transport"), s.state.get("tasks"), s.state.get("state"), s.state.get("down_since"),
                     s.state.get("circuit"), tools if json_out else ", ".join(tools), s.state.get("last_error")])  # fmt: skip
    reported = {s.upstream for s in states}
    for name in configured:
        if name not in reported:
            rows.append([name, None, None, None, "not reported", None, None, [] if json_out else "",
                         "no live process follows it (is serve or worker running with this file?)"])  # fmt: skip
    if not rows:
        print("no upstreams: MCP_TASKS_UPSTREAMS_FILE is not set, and no live process follows any", file=sys.stderr)
        return 0
    print_table(HEADER, sorted(rows, key=lambda r: (r[0], r[1] or "")), args.format or "text")
    return 0
