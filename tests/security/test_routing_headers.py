"""Issue 42 §6: a routing header sent twice (MCP-Protocol-Version, Mcp-Method, Mcp-Name,
Mcp-Param-*) is refused with -32020 and HTTP 400, so a gateway that reads another copy than ours can
never route a request to one method or task while we serve another."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.conftest import RunningServer
from tests.ext import V2026Client


@pytest.mark.parametrize(
    ("header", "values"),
    [
        ("Mcp-Method", ["tasks/get", "tasks/cancel"]),
        ("Mcp-Name", ["TASK", "another-task"]),
        ("Mcp-Name", ["TASK", "TASK"]),  # even the same value twice
        ("MCP-Protocol-Version", ["2026-07-28", "2025-11-25"]),
        ("Mcp-Param-Region", ["eu", "us"]),
    ],
)
async def test_a_duplicated_routing_header_is_refused_and_the_task_is_untouched(
    server: RunningServer, http: httpx.AsyncClient, header: str, values: list[str]
) -> None:
    c = V2026Client(http, server.url)
    created = await c.result("tools/call", {"name": "sleep", "arguments": {"seconds": 30}})
    task_id = created["taskId"]
    single = {k: v for k, v in c.headers("tasks/cancel", task_id).items() if k.lower() != header.lower()}
    headers = [*single.items(), *((header, v.replace("TASK", task_id)) for v in values)]
    body = c.body("tasks/cancel", {"taskId": task_id})
    r = await http.post(c.url, content=orjson.dumps(body), headers=headers)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == -32020
    assert "duplicated" in error["message"]
    assert error["message"].lower().count(header.lower()) == 1
    assert (await c.result("tasks/get", {"taskId": task_id}))["status"] == "working"  # not cancelled
