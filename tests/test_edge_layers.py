"""The MCP endpoint's layers, each alone (service/mcp/endpoint.py): the host and origin guard, the
reading of a JSON-RPC message, the choice of wire, the rate limit, authentication in single-user
mode, and the one mapping of what the layers raise to what the client is answered."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from starlette.datastructures import Headers
from starlette.types import Message

from service.auth.base import AuthFailure, SingleUser
from service.config import Settings
from service.domain import errors as d
from service.domain.principal import LOCAL_PRINCIPAL, Caller
from service.domain.task import Wire
from service.guard.ratelimit import RateLimiter
from service.mcp import jsonrpc
from service.mcp.authn import Authentication
from service.mcp.framing import read_message, wire_of
from service.mcp.guard import HostGuard
from service.mcp.http import RequestConnection, RequestHeaders
from service.mcp.refusal import Refusal, refusal_of
from service.mcp.throttle import Throttle
from service.store.db import APP_ROLE, Database
from service.tasks.audit import AuditLog

POST = {"content-type": "application/json", "accept": "application/json, text/event-stream"}


def settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {"host": "127.0.0.1", "port": 8000, "auth": "none", "database_url": "postgresql://x/y"}
    return Settings(**(values | overrides))


def headers(values: dict[str, str]) -> Headers:
    return Headers(headers=values)


def body(*chunks: bytes) -> Any:
    messages: list[Message] = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1} for i, chunk in enumerate(chunks)
    ]

    async def receive() -> Message:
        return messages.pop(0)

    return receive


def refused(excinfo: pytest.ExceptionInfo[Refusal]) -> tuple[int, int, bool]:
    return excinfo.value.status, excinfo.value.code, excinfo.value.envelope


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost", "[::1]:8000"])
def test_the_guard_serves_loopback_names_when_bound_to_loopback_H_ORIGIN_1(host: str) -> None:
    HostGuard(settings()).check(headers({"host": host}))


@pytest.mark.parametrize(
    "sent", [{"host": "evil.example.com"}, {"host": "127.0.0.1:8000", "origin": "https://evil.example.com"}]
)
def test_the_guard_refuses_foreign_hosts_and_origins_with_403_H_ORIGIN_2(sent: dict[str, str]) -> None:
    with pytest.raises(Refusal) as excinfo:
        HostGuard(settings()).check(headers(sent))
    assert refused(excinfo) == (403, jsonrpc.INVALID_REQUEST, True)


def test_the_guard_serves_the_public_hosts_name_and_the_allow_lists() -> None:
    guard = HostGuard(settings(public_url="https://mcp.example.com/mcp", allowed_origins="https://app.example.com"))
    guard.check(headers({"host": "mcp.example.com", "origin": "https://app.example.com"}))
    guard.check(headers({"host": "mcp.example.com", "origin": "https://mcp.example.com"}))


async def test_a_message_is_one_json_rpc_object_read_in_chunks() -> None:
    message = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    raw = orjson.dumps(message)
    assert await read_message(body(raw[:5], raw[5:]), headers(POST), max_body_bytes=1000) == message


@pytest.mark.parametrize(
    ("sent", "chunks", "expected"),
    [
        ({"content-type": "text/plain", "accept": POST["accept"]}, [b"{}"], (415, jsonrpc.INVALID_REQUEST)),
        ({**POST, "accept": "application/json"}, [b"{}"], (406, jsonrpc.INVALID_REQUEST)),  # H-POST-1
        ({**POST, "content-length": "2000"}, [b"{}"], (413, jsonrpc.INVALID_REQUEST)),
        (POST, [b"x" * 600, b"x" * 600], (413, jsonrpc.INVALID_REQUEST)),  # over the limit while it streams
        (POST, [b"{not json"], (400, jsonrpc.PARSE_ERROR)),
        (POST, [b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]'], (400, jsonrpc.INVALID_REQUEST)),  # H-GEN-3
        (POST, [b'{"id": 1, "method": "ping"}'], (400, jsonrpc.INVALID_REQUEST)),
        (POST, [b'{"jsonrpc": "2.0", "method": "x", "params": {"a": "\\u0000"}}'], (400, jsonrpc.INVALID_REQUEST)),
    ],
)
async def test_a_message_that_cannot_be_read_is_refused_without_an_id_H_POST_3(
    sent: dict[str, str], chunks: list[bytes], expected: tuple[int, int]
) -> None:
    with pytest.raises(Refusal) as excinfo:
        await read_message(body(*chunks), headers(sent), max_body_bytes=1000)
    assert refused(excinfo) == (*expected, True)
    assert excinfo.value.request_id is None


async def test_a_request_holding_a_nul_is_refused_with_its_own_id() -> None:
    raw = b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "a\\u0000"}}'
    with pytest.raises(Refusal) as excinfo:
        await read_message(body(raw), headers(POST), max_body_bytes=1000)
    assert (excinfo.value.status, excinfo.value.code, excinfo.value.request_id) == (200, jsonrpc.INVALID_PARAMS, 7)


@pytest.mark.parametrize(
    ("version", "message", "wire"),
    [
        ("2026-07-28", {"method": "initialize"}, Wire.V2026),
        (None, {"method": "initialize"}, Wire.V2025),
        ("2025-11-25", {"method": "tools/list"}, Wire.V2025),
        ("2025-06-18", {"method": "tools/list"}, Wire.V2025),
        (None, {"method": "tools/list", "params": {}}, Wire.V2025),
    ],
)
def test_the_wire_is_decided_from_the_request_alone_X_HTTP_4(
    version: str | None, message: dict[str, Any], wire: Wire
) -> None:
    sent = {} if version is None else {"mcp-protocol-version": version}
    assert wire_of(headers(sent), {"jsonrpc": "2.0", "id": 1, **message}) is wire


def test_a_2026_request_without_its_version_header_and_an_unknown_version_are_refused_X_HTTP_4() -> None:
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}
    with pytest.raises(Refusal) as missing:
        wire_of(headers({}), {"jsonrpc": "2.0", "id": 3, "method": "tools/list", "params": {"_meta": meta}})
    assert (missing.value.status, missing.value.code, missing.value.request_id) == (400, -32020, 3)
    with pytest.raises(Refusal) as unknown:
        wire_of(headers({"mcp-protocol-version": "1999-01-01"}), {"jsonrpc": "2.0", "id": 4, "method": "ping"})
    assert (unknown.value.status, unknown.value.code) == (400, -32022)
    assert unknown.value.data == {"supported": ["2026-07-28", "2025-11-25"], "requested": "1999-01-01"}


@pytest.fixture
async def audit(database_url: str) -> AsyncIterator[AuditLog]:
    db = Database(database_url, pool_size=1, role=APP_ROLE)
    await db.open()
    try:
        yield AuditLog(db)
    finally:
        await db.close()


@pytest.mark.parametrize(("version", "code"), [(None, -32029), ("2026-07-28", -31029)])
async def test_a_principal_over_its_rate_gets_429_with_retry_after_in_its_wires_code_X_ERR_2(
    version: str | None, code: int, audit: AuditLog
) -> None:
    throttle = Throttle(RateLimiter(settings(rate_limit="2/minute")), audit, tenant_share=512)
    caller = Caller(LOCAL_PRINCIPAL, "r", "127.0.0.1")
    sent = headers({} if version is None else {"mcp-protocol-version": version})
    await throttle.check(caller, sent)
    await throttle.check(caller, sent)
    with pytest.raises(Refusal) as excinfo:
        await throttle.check(caller, sent)
    assert (excinfo.value.status, excinfo.value.code) == (429, code)
    assert int(excinfo.value.headers["Retry-After"]) > 0


async def test_single_user_mode_authenticates_every_request_as_the_local_principal(audit: AuditLog) -> None:
    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/mcp", "headers": [], "query_string": b""}
    sent = RequestHeaders(scope)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    authn = Authentication(SingleUser(), RateLimiter(settings()), audit)
    got = await authn.principal(scope, RequestConnection(scope, receive, sent), sent, "127.0.0.1", "r")
    assert got == LOCAL_PRINCIPAL


@pytest.mark.parametrize(
    ("raised", "wire", "answered"),
    [
        (d.TaskNotFound("no"), Wire.V2025, (200, jsonrpc.INVALID_PARAMS, 1)),
        (d.CapacityExceeded("full"), Wire.V2025, (200, -32000, 1)),
        (d.CapacityExceeded("full"), Wire.V2026, (200, -31000, 1)),
        (d.StorageQuotaExceeded("kept too much"), Wire.V2025, (200, -32004, 1)),
        (d.StorageQuotaExceeded("kept too much"), Wire.V2026, (200, -31004, 1)),
        (d.Unavailable("down"), Wire.V2026, (503, -31001, 1)),
        (d.TaskSupportMismatch("no"), Wire.V2025, (200, jsonrpc.METHOD_NOT_FOUND, 1)),
        (AuthFailure(401, "invalid_token", "bad", {"WWW-Authenticate": "Bearer"}), Wire.V2025, (401, -32600, None)),
    ],
)
def test_what_the_layers_raise_is_mapped_in_one_place_per_wire(
    raised: Exception, wire: Wire, answered: tuple[int, int, int | None]
) -> None:
    refusal = refusal_of(raised, wire=wire, request_id=1)
    assert refusal is not None
    assert (refusal.status, refusal.code, refusal.request_id) == answered
    assert refusal_of(RuntimeError("a bug"), wire=wire) is None


def test_every_json_rpc_code_the_service_answers_has_its_own_metric_label() -> None:
    """Issue 44 §3: -31001 (2026-07-28's service unavailable) was labelled code="other", so the
    error-budget rule never counted it. Every code the wires can answer is its own label."""
    from service.mcp import jsonrpc, v2026_request
    from service.observability.metric_labels import rpc_code

    codes = {v for k, v in vars(jsonrpc).items() if k.isupper() and isinstance(v, int) and v < 0}
    codes |= {v2026_request.RESOURCE_NOT_FOUND}
    assert {-31001, -32001, -32603, -32020, -32700} <= codes
    assert {code: rpc_code(code) for code in codes} == {code: str(code) for code in codes}
    assert rpc_code(12345) == rpc_code(None) == "other"  # bounded: anything else is one label
