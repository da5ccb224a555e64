"""Random JSON-RPC bodies never get a 500 or a traceback, and never touch an existing task."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.app import create_app
from tests.conftest import free_port, make_settings
from tests.rpc import ACCEPT_BOTH

METHODS = [
    "initialize", "ping", "tools/list", "tools/call", "tasks/get", "tasks/result", "tasks/list", "tasks/cancel",
    "notifications/initialized", "notifications/cancelled", "resources/read", "prompts/get", "completion/complete",
]  # fmt: skip
ALLOWED_STATUS = {200, 202, 400, 403, 404, 406, 413, 415}

strings = st.text(max_size=30) | st.sampled_from(["a\x00b", "\x00", "[", "../", "𝄞", "\u2028"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=False) | strings,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
ids = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=12)
tool_params = st.fixed_dictionaries(
    {"name": st.sampled_from(["echo", "sleep", "crash", "confirm", "nope", ""]) | json_values},
    optional={
        "arguments": json_values | st.fixed_dictionaries({"text": json_values, "seconds": json_values}),
        "task": json_values | st.fixed_dictionaries({}, optional={"ttl": json_values}),
        "_meta": json_values | st.fixed_dictionaries({"progressToken": json_values}),
    },
)
task_params = st.fixed_dictionaries({}, optional={"taskId": json_values, "cursor": json_values})
messages = st.fixed_dictionaries(
    {},
    optional={
        "jsonrpc": st.sampled_from(["2.0", "2.0", "2.0", "1.0"]) | json_values,
        "id": ids,
        "method": st.sampled_from(METHODS) | st.text(max_size=20) | json_values,
        "params": tool_params | task_params | json_values,
        "result": json_values,
        "error": json_values,
    },
)
extra_headers = st.fixed_dictionaries(
    {},
    optional={
        "Host": st.sampled_from(["[", "[::1", "evil.example.com", "127.0.0.1:1", "localhost", ""]),
        "Origin": st.sampled_from(["http://[", "null", "https://evil.example.com", "http://localhost:3000", "x"]),
        "MCP-Protocol-Version": st.sampled_from(["2025-11-25", "2025-03-26", "1999-01-01", ""]),
        "Accept": st.sampled_from(["*/*", "text/html", "application/json", ""]),
    },
)
bodies = messages.map(orjson.dumps) | st.lists(messages, max_size=3).map(orjson.dumps) | st.binary(max_size=200)


@pytest.fixture
def threaded_server(database_url: str) -> Iterator[str]:
    """The app on uvicorn in a thread of its own, so hypothesis can drive it synchronously."""
    port = free_port()
    app = create_app(make_settings(database_url, port=port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="none"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "server thread died during start-up"
        assert time.monotonic() < deadline, "server did not start in 30 s"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/mcp"
    server.should_exit = True
    thread.join(timeout=15)


def _session(http: httpx.Client, url: str) -> dict[str, str]:
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "fuzz", "version": "1"}},
    }
    r = http.post(url, json=init, headers={"Accept": ACCEPT_BOTH})
    return {"Mcp-Session-Id": r.headers["mcp-session-id"], "MCP-Protocol-Version": "2025-11-25"}


def _check_response(r: httpx.Response) -> None:
    assert r.status_code in ALLOWED_STATUS, (r.status_code, r.text[:300])
    assert "Traceback" not in r.text
    if r.status_code == 202:
        assert r.content == b""
        return
    if r.headers.get("content-type", "").startswith("application/json"):
        message: Any = r.json()
        assert message["jsonrpc"] == "2.0"
        if "error" in message:
            assert isinstance(message["error"]["code"], int)
            assert isinstance(message["error"]["message"], str)
            assert message["error"]["code"] != -32603 or "internal error" not in message["error"]["message"]
        else:
            assert "result" in message


def test_random_json_rpc_bodies_get_clear_errors_never_500(threaded_server: str) -> None:
    url = threaded_server
    with httpx.Client(timeout=httpx.Timeout(10.0, read=3.0)) as http:
        session = _session(http, url)
        headers = {"Accept": ACCEPT_BOTH, "Content-Type": "application/json", **session}
        create = {"jsonrpc": "2.0", "id": 1, "method": "tools/call"}
        create["params"] = {"name": "echo", "arguments": {"text": "keep me"}, "task": {}}
        task_id = http.post(url, json=create, headers=headers).json()["result"]["task"]["taskId"]

        @settings(
            max_examples=300,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(body=bodies, with_session=st.booleans(), extra=extra_headers)
        def check(body: bytes, with_session: bool, extra: dict[str, str]) -> None:
            h = headers if with_session else {"Accept": ACCEPT_BOTH, "Content-Type": "application/json"}
            try:
                r = http.post(url, content=body, headers={**h, **extra})
            except httpx.ReadTimeout:
                assert b"tasks/result" in body, "only a blocking tasks/result may keep the client waiting"
                return
            _check_response(r)

        check()

        got = http.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tasks/result", "params": {"taskId": task_id}},
                        headers=headers).json()  # fmt: skip
        assert got["result"]["content"] == [{"type": "text", "text": "keep me"}]
        assert http.get(url.removesuffix("/mcp") + "/readyz").status_code == 200
