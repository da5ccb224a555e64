"""HTTP-level answers of the MCP endpoint: refusals outside JSON-RPC, and JSON bodies."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.types import Receive, Scope, Send

from service.mcp import jsonrpc


class RequestHeaders(Headers):
    """Starlette's ``Headers`` (read-only) answering ``get``, ``[]`` and ``in`` from a dict built once:
    ``Headers`` scans and decodes the whole header list on every lookup, and a request makes about
    a dozen. The first of repeated headers wins, as with ``Headers.get``."""

    def __init__(self, scope: Scope) -> None:
        super().__init__(scope=scope)
        # Built last to first, so the first of repeated headers is the one kept. ASGI servers send
        # names lowercased; a name that is not is lowercased here (the spec asks it of them).
        self._first = {
            (name if name.islower() else name.lower()): value.decode("latin-1")
            for name, value in ((key.decode("latin-1"), value) for key, value in reversed(self._list))
        }

    def __getitem__(self, key: str) -> str:
        try:
            return self._first[key.lower()]
        except KeyError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return self._first.get(key.lower(), default)

    def __contains__(self, key: Any) -> bool:
        return isinstance(key, str) and key.lower() in self._first


class RequestConnection(HTTPConnection):
    """The request as the authenticator sees it, sharing the request's ``RequestHeaders``."""

    def __init__(self, scope: Scope, receive: Receive, headers: RequestHeaders) -> None:
        super().__init__(scope, receive)
        self._request_headers = headers

    @property
    def headers(self) -> Headers:
        return self._request_headers


class HttpError(Exception):
    """An HTTP-level refusal, answered with a JSON-RPC error body without id (H-POST-3)."""

    def __init__(self, status: int, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


async def send_json(send: Send, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
    payload = b"" if body is None else jsonrpc.dumps(body)
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if body is not None:
        raw.append((b"content-type", b"application/json"))
    raw.append((b"content-length", str(len(payload)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
