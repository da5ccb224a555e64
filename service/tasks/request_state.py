"""The requestState of a multi-round-trip call (2026-07-28): the answers so far, sealed.

A call that asks before it becomes a task answers with an InputRequiredResult; the client retries
with ``inputResponses`` and the ``requestState`` it got. Nothing of the round is kept on the server:
the state carries the answers collected so far, so a later round needs to send only its new ones.
It is attacker-controlled (X-SEC-10), so it is authenticated (HMAC-SHA256 with a key every replica
shares), bound to the principal, the tool and its arguments, and it expires.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from typing import Any

import orjson

from service.domain.errors import InvalidArguments
from service.domain.principal import Principal

_TAG_BYTES = 16
LIFETIME_S = 900


class RequestStateCodec:
    def __init__(self, key: bytes, *, lifetime_s: float = LIFETIME_S) -> None:
        self._key = key
        self._lifetime_s = lifetime_s

    def _tag(self, principal: Principal, tool: str, arguments: dict[str, Any], body: bytes) -> bytes:
        bound = orjson.dumps([principal.tenant_id, principal.subject, principal.issuer, tool, arguments],
                             option=orjson.OPT_SORT_KEYS)  # fmt: skip
        return hmac.new(self._key, bound + b"\x00" + body, hashlib.sha256).digest()[:_TAG_BYTES]

    def seal(self, principal: Principal, tool: str, arguments: dict[str, Any], answers: dict[str, Any]) -> str:
        """A new state for these answers (a fresh nonce: every round's state differs)."""
        expires = int((time.time() + self._lifetime_s) * 1000)
        body = orjson.dumps([expires, secrets.token_urlsafe(8), answers])
        return base64.urlsafe_b64encode(self._tag(principal, tool, arguments, body) + body).decode().rstrip("=")

    def open(self, principal: Principal, tool: str, arguments: dict[str, Any], state: str) -> dict[str, Any]:
        """The answers a state carries; InvalidArguments if it was altered, is another call's, or expired."""
        try:
            raw = base64.urlsafe_b64decode(state + "=" * (-len(state) % 4))
            tag, body = raw[:_TAG_BYTES], raw[_TAG_BYTES:]
            if not hmac.compare_digest(tag, self._tag(principal, tool, arguments, body)):
                raise ValueError("bad tag")
            expires, _nonce, answers = orjson.loads(body)
        except (ValueError, TypeError, orjson.JSONDecodeError):
            raise InvalidArguments(
                "invalid requestState: pass back the requestState of the previous round unchanged, with the same "
                "tool and arguments"
            ) from None
        if not isinstance(answers, dict) or not isinstance(expires, int) or expires < time.time() * 1000:
            raise InvalidArguments("requestState expired: call the tool again without it")
        return answers
