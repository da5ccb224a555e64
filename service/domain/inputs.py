"""Questions a running call asks its client, and the client's answers: wire-neutral records.

A pending input is ``(key, kind, params)``. Its key is unique for the task's whole life (X-INPUT-4):
the 2025-11-25 wire uses it as the id of its server-to-client request, the 2026-07-28 extension as
the key of ``inputRequests``/``inputResponses``. ``params`` are the question's own fields (for an
elicitation: mode, message, requestedSchema), without anything a wire adds.
"""

from __future__ import annotations

import enum
import secrets
from typing import Any

from service.domain.errors import InvalidArguments
from service.domain.values import frozen


class InputKind(enum.StrEnum):
    ELICITATION = "elicitation"
    SAMPLING = "sampling"
    ROOTS = "roots"


@frozen
class PendingInput:
    key: str
    kind: InputKind
    params: dict[str, Any]


@frozen
class InputResponse:
    """The client's answer: a result object, or (2025-11-25 only) the error it answered with."""

    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    def to_stored(self) -> dict[str, Any]:
        return {"error": self.error} if self.error is not None else {"result": self.result}

    @classmethod
    def from_stored(cls, stored: dict[str, Any]) -> InputResponse:
        if "error" in stored:
            error = stored["error"]
            return cls(error=error if isinstance(error, dict) else {})
        result = stored.get("result")
        return cls(result=result if isinstance(result, dict) else {})


def new_input_key() -> str:
    """Unguessable, so a key never names two questions, and unique across the tenant's tasks."""
    return f"in-{secrets.token_urlsafe(12)}"


ELICIT_ACTIONS = frozenset({"accept", "decline", "cancel"})


def check_response(kind: InputKind, response: InputResponse) -> None:
    """XD-9: a result must parse as the answer to its kind of question (error answers pass as they are)."""
    if response.error is not None:
        return
    result = response.result
    if not isinstance(result, dict):
        raise InvalidArguments("an input response must be an object")
    if kind is InputKind.ELICITATION:
        if result.get("action") not in ELICIT_ACTIONS:
            raise InvalidArguments('an elicitation answer needs "action": "accept", "decline" or "cancel"')
        content = result.get("content")
        if content is not None and not isinstance(content, dict):
            raise InvalidArguments("an elicitation answer's content must be an object")
        for name, value in (content or {}).items():
            if not _form_value(value):
                raise InvalidArguments(
                    f"an elicitation answer's content.{str(name)[:64]} must be a string, a number, a boolean or a "
                    "list of strings"
                )
    elif kind is InputKind.SAMPLING:
        if not isinstance(result.get("role"), str) or "content" not in result:
            raise InvalidArguments("a sampling answer needs role and content")
    elif kind is InputKind.ROOTS and not isinstance(result.get("roots"), list):
        raise InvalidArguments("a roots answer needs a roots list")


def _form_value(value: Any) -> bool:
    """A value of an elicitation form's answer (the schemas' ElicitResult.content; a number may have
    a fraction, as a number field's answer does; null for a field left empty)."""
    if value is None or isinstance(value, str | bool | int | float):
        return True
    return isinstance(value, list) and all(isinstance(item, str) for item in value)
