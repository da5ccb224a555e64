"""Opaque, tamper-proof list cursors, bound to the principal that received them (T-LIST-4)."""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import UTC, datetime

import orjson

from service.domain.errors import InvalidCursor
from service.domain.principal import Principal

_TAG_BYTES = 16


class CursorCodec:
    def __init__(self, key: bytes) -> None:
        self._key = key

    def _tag(self, principal: Principal, body: bytes) -> bytes:
        bound = f"{principal.tenant_id}\x00{principal.subject}\x00".encode() + body
        return hmac.new(self._key, bound, hashlib.sha256).digest()[:_TAG_BYTES]

    def encode(self, principal: Principal, created_at: datetime, task_id: str) -> str:
        micros = int(created_at.timestamp() * 1_000_000)
        body = orjson.dumps([micros, task_id])
        return base64.urlsafe_b64encode(self._tag(principal, body) + body).decode().rstrip("=")

    def decode(self, principal: Principal, cursor: str) -> tuple[datetime, str]:
        try:
            raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
            tag, body = raw[:_TAG_BYTES], raw[_TAG_BYTES:]
            if not hmac.compare_digest(tag, self._tag(principal, body)):
                raise ValueError("bad tag")
            micros, task_id = orjson.loads(body)
            if not isinstance(micros, int) or not isinstance(task_id, str):
                raise ValueError("bad body")
            return datetime.fromtimestamp(micros / 1_000_000, tz=UTC), task_id
        except (ValueError, TypeError, orjson.JSONDecodeError):
            raise InvalidCursor("invalid cursor: pass back the cursor a listing returned, unchanged") from None
