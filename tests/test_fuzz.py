"""Random JSON-RPC bodies never get a 500 or a traceback, and never touch an existing task."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.app import create_app
from service.http_server import server_config
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
# Plain calls that say something before their result, so the reply is an SSE stream to check too.
streaming_calls = st.fixed_dictionaries(
    {
        "jsonrpc": st.just("2.0"),
        "id": st.integers(1, 2**31) | st.text(min_size=1, max_size=12),
        "method": st.just("tools/call"),
        "params": st.fixed_dictionaries(
            {
                "name": st.just("count"),
                "arguments": st.fixed_dictionaries({"n": st.integers(1, 3), "interval_ms": st.just(0)}),
                "_meta": st.fixed_dictionaries({"progressToken": st.integers(-(2**63), 2**63) | strings | json_values}),
            }
        ),
    }
)
bodies = (
    messages.map(orjson.dumps)
    | st.lists(messages, max_size=3).map(orjson.dumps)
    | st.binary(max_size=200)
    | streaming_calls.map(orjson.dumps)
)


@pytest.fixture
def threaded_server(database_url: str) -> Iterator[str]:
    """The app on uvicorn in a thread of its own, so hypothesis can drive it synchronously."""
    port = free_port()
    settings = make_settings(database_url, port=port)
    app = create_app(settings)
    server = uvicorn.Server(server_config(app, settings, host="127.0.0.1", port=port, log_level="warning"))
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


def _check_message(message: Any) -> None:
    assert isinstance(message, dict), message
    assert message["jsonrpc"] == "2.0"
    if "method" in message:  # a request or notification from the server, on an SSE stream
        assert isinstance(message["method"], str)
    elif "error" in message:
        assert isinstance(message["error"]["code"], int)
        assert isinstance(message["error"]["message"], str)
        assert message["error"]["code"] != -32603 or "internal error" not in message["error"]["message"]
    else:
        assert "result" in message


def _sse_data(text: str) -> list[Any]:
    events, data = [], []
    for line in re.split(r"\r\n|\r|\n", text):  # SSE's line ends, not splitlines()'s U+2028 too
        if line.startswith("data:"):
            data.append(line.removeprefix("data:").lstrip(" "))
        elif line == "" and data:
            events.append(orjson.loads("\n".join(data)))
            data = []
    assert not data, "an SSE event was cut off"
    return events


def _check_response(r: httpx.Response) -> str:
    """Checks one reply; says which kind it was."""
    assert r.status_code in ALLOWED_STATUS, (r.status_code, r.text[:300])
    assert "Traceback" not in r.text
    content_type = r.headers.get("content-type", "")
    if r.status_code == 202:
        assert r.content == b""
        return "accepted"
    if content_type.startswith("text/event-stream"):
        assert r.status_code == 200
        messages = _sse_data(r.text)
        assert messages, "an SSE reply without a message"
        for message in messages:
            _check_message(message)
        assert "method" not in messages[-1], "an SSE reply must end with its response"
        assert all("method" in m for m in messages[:-1]), "only the last message is a response"
        return "sse"
    if content_type.startswith("application/json"):
        _check_message(r.json())
        return "json"
    return "other"


def _may_keep_the_client_waiting(body: bytes) -> bool:
    """The one request these strategies can make that rightly says nothing for seconds: a plain
    call of the demo sleep tool (a tasks/result could too, but no fuzzed id names a running task)."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    params = message.get("params") if isinstance(message, dict) else None
    return message.get("method") == "tools/call" and isinstance(params, dict) and params.get("name") == "sleep"


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
                assert _may_keep_the_client_waiting(body), f"no reply in 3 s to {body[:300]!r}"
                return
            kinds[_check_response(r)] += 1

        kinds: Counter[str] = Counter()
        check()
        assert kinds["sse"] > 0, kinds  # both kinds of reply were checked
        assert kinds["json"] > 0, kinds

        got = http.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tasks/result", "params": {"taskId": task_id}},
                        headers=headers).json()  # fmt: skip
        assert got["result"]["content"] == [{"type": "text", "text": "keep me"}]
        assert http.get(url.removesuffix("/mcp") + "/readyz").status_code == 200
