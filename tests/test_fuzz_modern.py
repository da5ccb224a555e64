"""Random 2026-07-28 bodies and headers get the error §11 names, never a 500, and touch no task."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ext import DECLARING, EXT, MODERN
from tests.test_fuzz import json_values, strings, threaded_server  # noqa: F401 (a fixture)

METHODS = ["server/discover", "tools/list", "tools/call", "tasks/get", "tasks/update", "tasks/cancel",
           "subscriptions/listen", "tasks/result", "tasks/list", "ping", "initialize"]  # fmt: skip
ALLOWED_STATUS = {200, 202, 400, 403, 404, 405, 406, 413, 415}
KNOWN_CODES = {-32700, -32600, -32601, -32602, -32603, -32020, -32021, -32022, -31000, -31001, -31004, -31029}

capabilities = (
    st.sampled_from([DECLARING, {}, {"tasks": {}}, {"extensions": {EXT: True}}, {"extensions": []}]) | json_values
)
meta = st.fixed_dictionaries(
    {},
    optional={
        "io.modelcontextprotocol/protocolVersion": st.sampled_from([MODERN, "2025-11-25", "2026-06-30"]) | json_values,
        "io.modelcontextprotocol/clientCapabilities": capabilities,
        "progressToken": json_values,
    },
)
params = st.fixed_dictionaries(
    {"_meta": meta | json_values},
    optional={
        "name": st.sampled_from(["echo", "sleep", "confirm", "batch", "nope"]) | json_values,
        "arguments": json_values | st.fixed_dictionaries({"text": json_values, "seconds": st.just(0.05)}),
        "taskId": st.sampled_from(["x", "unknown"]) | json_values,
        "inputResponses": json_values | st.dictionaries(st.sampled_from(["q1", "q2", "k"]), json_values, max_size=3),
        "notifications": json_values | st.fixed_dictionaries({}, optional={"taskIds": json_values}),
    },
)
messages = st.fixed_dictionaries(
    {"jsonrpc": st.just("2.0"), "method": st.sampled_from(METHODS) | strings},
    optional={"id": st.integers(0, 10**6) | st.text(max_size=8) | json_values, "params": params | json_values},
)
header_text = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20)
headers = st.fixed_dictionaries(
    {"MCP-Protocol-Version": st.sampled_from([MODERN, MODERN, MODERN, "2026-06-30", "2025-11-25"])},
    optional={
        "Mcp-Method": st.sampled_from(METHODS) | header_text,
        "Mcp-Name": st.sampled_from(["x", "echo", "=?base64?eA==?=", "=?base64?!!?="]) | header_text,
    },
)


def test_random_modern_requests_get_clear_errors_never_500(threaded_server: str) -> None:  # noqa: F811
    url = threaded_server
    base = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    with httpx.Client(timeout=httpx.Timeout(10.0, read=3.0)) as http:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "echo", "arguments": {"text": "keep me"},
                           "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                     "io.modelcontextprotocol/clientCapabilities": DECLARING}}}  # fmt: skip
        kept = http.post(url, content=orjson.dumps(body), headers={**base, "MCP-Protocol-Version": MODERN,
                                                                   "Mcp-Method": "tools/call", "Mcp-Name": "echo"})  # fmt: skip
        assert kept.json()["result"]["content"][0]["text"] == "keep me"

        @settings(max_examples=300, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
        @given(message=messages, extra=headers, matched=st.booleans())
        def check(message: dict[str, Any], extra: dict[str, str], matched: bool) -> None:
            h = {**base, **extra}
            if (
                matched
                and isinstance(message.get("method"), str)
                and message["method"].isascii()
                and message["method"].isprintable()
                and message["method"] == message["method"].strip()  # h11 refuses a value with blank edges
            ):
                h["Mcp-Method"] = message["method"]
            try:
                r = http.post(url, content=orjson.dumps(message), headers=h)
            except httpx.ReadTimeout:
                assert message.get("method") in ("subscriptions/listen", "tools/call"), "only a stream may wait"
                return
            assert r.status_code in ALLOWED_STATUS, (r.status_code, r.text[:300])
            assert "Traceback" not in r.text
            if r.headers.get("content-type", "").startswith("application/json"):
                reply: Any = r.json()
                if "error" in reply:
                    assert reply["error"]["code"] in KNOWN_CODES, reply
                    assert "internal error" not in reply["error"]["message"], reply

        check()
        assert http.get(url.removesuffix("/mcp") + "/readyz").status_code == 200
