"""The one tool context: what a tool may do while it runs, whether as a task or inside its request.

The base keeps the rules (progress only increases, ask only what the client declared, parse the
answer); a subclass says where events go and how a question reaches the client and its answer
comes back. Nothing here knows a wire: events and questions are domain records.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from service.domain.events import LogEntry, Progress, TaskEvent
from service.domain.inputs import InputKind, InputResponse, PendingInput, new_input_key
from service.domain.task import FailureReason
from service.tools.api import ElicitAnswer, InputNotSupported, ToolFailure, refused

# What a task's status message takes a progress report with: (progress, total, message).
ProgressNote = Callable[[float, float | None, str | None], None]


def progress_text(progress: float, total: float | None, message: str | None) -> str:
    """A progress report as a status message: "40 % — processed 4 of 10 files"."""
    if total:
        share = f"{max(0, min(100, round(100 * progress / total)))} %"
        return f"{share} — {message}" if message else share
    if message:
        return message
    return f"progress {progress:g}"


def supports_form_elicitation(capabilities: dict[str, Any]) -> bool:
    """T-CAP-8: an empty elicitation object means form mode; otherwise form must be listed."""
    elicitation = capabilities.get("elicitation")
    return isinstance(elicitation, dict) and (not elicitation or "form" in elicitation)


def require_capability(capabilities: dict[str, Any], kind: InputKind) -> None:
    """A tool may only ask the client for what the client declared (T-CAP-8, D-6, X-NEG-12, XD-4)."""
    if kind is InputKind.ELICITATION and not supports_form_elicitation(capabilities):
        raise InputNotSupported(
            "this tool needs form elicitation, but the client did not declare it in capabilities.elicitation; "
            "call it from a client that supports form elicitation"
        )
    if kind.value not in capabilities:
        raise InputNotSupported(
            f"this tool needs {kind.value} from the client, but the client did not declare the {kind.value!r} "
            f"capability; call it from a client that supports {kind.value}"
        )


def _client_refused(response: InputResponse, what: str) -> ToolFailure:
    err = response.error or {}
    code = err.get("code")
    return refused(
        FailureReason.TOOL,
        f"the client refused the {what}: {err.get('message', 'no message')}",
        code=code if isinstance(code, int) and not isinstance(code, bool) else None,
    )


class ToolContextBase(abc.ABC):
    """Implements the tool authors' ``ToolContext`` for one call."""

    def __init__(
        self, *, task_id: str | None, progress_token: str | int | None, client_capabilities: dict[str, Any],
        caller: tuple[str, str] | None = None,
    ) -> None:  # fmt: skip
        self._caller = caller
        self._note: dict[str, Any] | None = None
        self._task_id = task_id
        self._token = progress_token
        self._caps = client_capabilities
        self._last_progress: float | None = None

    @property
    def task_id(self) -> str | None:
        return self._task_id

    @property
    def caller(self) -> tuple[str, str] | None:
        return self._caller

    @property
    def reports_progress(self) -> bool:
        return self._token is not None or self._progress_status() is not None

    def _progress_status(self) -> ProgressNote | None:
        """Where progress goes when no token carries it to the client (a 2026-07-28 task's status
        message), if anywhere."""
        return None

    @abc.abstractmethod
    async def _emit(self, event: TaskEvent) -> None:
        """Pass an event on (best effort: progress and logs are never stored)."""

    @abc.abstractmethod
    async def _ask(self, question: PendingInput) -> InputResponse:
        """Put the question to the client and wait for its answer."""

    async def progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        """T-PROG-1/3: with the creating request's token (else to the task's status, where a wire
        carries no progress); values that do not increase are dropped."""
        if self._last_progress is not None and progress <= self._last_progress:
            return
        if self._token is not None:
            self._last_progress = progress
            await self._emit(Progress(self._task_id, self._token, progress, total, message))
        elif (note := self._progress_status()) is not None:
            self._last_progress = progress
            note(progress, total, message)

    async def log(self, level: str, data: Any, logger: str | None = None) -> None:
        await self._emit(LogEntry(self._task_id, level, data, logger))

    async def status(self, message: str) -> None:
        """A call that is not a task has no status message: nothing to write."""
        return None

    @property
    def durable(self) -> bool:
        return False

    async def remember(self, note: dict[str, Any]) -> None:
        """Here, for the call's life; a task's context keeps it with the task."""
        self._note = note

    async def recall(self) -> dict[str, Any] | None:
        return self._note

    async def cancelled(self) -> bool:
        """A call that is not a task ends with its request: a cancel is the call's."""
        return True

    async def elicit(self, message: str, requested_schema: dict[str, Any], *, key: str | None = None) -> ElicitAnswer:
        params = {"mode": "form", "message": message, "requestedSchema": requested_schema}
        response = await self._question(InputKind.ELICITATION, params, key)
        if response.error is not None:
            raise _client_refused(response, "elicitation")
        result = response.result or {}
        action = result.get("action")
        if action not in ("accept", "decline", "cancel"):
            raise refused(
                FailureReason.INVALID_INPUT, "the client answered the elicitation with an invalid ElicitResult"
            )
        content = result.get("content")
        return ElicitAnswer(action, content if isinstance(content, dict) else None)

    async def sample(self, params: dict[str, Any], *, key: str | None = None) -> dict[str, Any]:
        response = await self._question(InputKind.SAMPLING, dict(params), key)
        if response.error is not None or response.result is None:
            raise _client_refused(response, "sampling request")
        return response.result

    async def list_roots(self, *, key: str | None = None) -> list[dict[str, Any]]:
        response = await self._question(InputKind.ROOTS, {}, key)
        if response.error is not None or response.result is None:
            raise _client_refused(response, "roots request")
        roots = response.result.get("roots")
        return [r for r in roots if isinstance(r, dict)] if isinstance(roots, list) else []

    def _next_key(self, wanted: str | None) -> str:
        """The key of the next question: random, so unique for a task's whole life (X-INPUT-4);
        a context where the tool may name it (``wanted``) overrides this."""
        return new_input_key()

    async def _question(self, kind: InputKind, params: dict[str, Any], key: str | None) -> InputResponse:
        require_capability(self._caps, kind)
        return await self._ask(PendingInput(self._next_key(key), kind, params))
