"""What a tool sees: its context, result helpers, and the errors it may raise."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Literal, Protocol

from service.domain.task import FailureReason
from service.domain.values import frozen

ElicitAction = Literal["accept", "decline", "cancel"]


@frozen
class ElicitAnswer:
    action: ElicitAction
    content: dict[str, Any] | None = None


@frozen
class ToolResult:
    """A CallToolResult: content blocks, optional structured content, optional error flag."""

    content: list[dict[str, Any]] = field(default_factory=list)
    structured: dict[str, Any] | None = None
    is_error: bool = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"content": self.content}
        if self.structured is not None:
            out["structuredContent"] = self.structured
        if self.is_error:
            out["isError"] = True
        return out


class ToolError(Exception):
    """Raised by a tool for an error the model should see: becomes ``isError: true``."""


class ToolFailure(Exception):
    """Raised by a tool to end its call as failed, without a result: a protocol error on the wire
    (replayed as the result on 2025-11-25; ``failed`` with ``error`` on the extension). The service picks the
    error code unless ``code`` names one."""

    def __init__(self, message: str, *, code: int | None = None, data: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.data = data


class RpcError(ToolFailure):
    """A ToolFailure with the JSON-RPC error code the tool chooses."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message, code=code, data=data)


class Refusal(ToolFailure):
    """A failure the service raises inside a tool's call (not the tool's own): the client's answer
    could not be used, no answer came, ... ``reason`` is what the outcome records."""

    def __init__(self, reason: FailureReason, message: str, *, code: int | None = None) -> None:
        super().__init__(message, code=code)
        self.reason = reason


def refused(reason: FailureReason, message: str, *, code: int | None = None) -> ToolFailure:
    return Refusal(reason, message, code=code)


class InputNotSupported(ToolError):
    """The client cannot answer an elicitation (it did not declare the capability)."""


class ToolContext(Protocol):
    """Everything a tool may do besides computing: report progress, ask for input, log."""

    @property
    def task_id(self) -> str | None: ...

    @property
    def caller(self) -> tuple[str, str] | None:
        """Who the call is for: (tenant, subject) as the audit records them; None where no one is
        known. An upstream may be told (``[upstream.forward]``); a pack's tool may scope by it."""
        ...

    @property
    def reports_progress(self) -> bool:
        """Whether ``progress`` reaches anyone now: the client sent a progress token with the call
        (2026-07-28: while the call runs inside that request, XD-18), or the call is a 2026-07-28
        task, whose status message carries its progress (X-NOTIF-8; docs/decisions.md, "Progress
        as status"). It may change while the tool runs (a call becomes a task). A tool whose only
        reason to wake up is to report progress can skip it when this is False."""
        ...

    async def progress(self, progress: float, total: float | None = None, message: str | None = None) -> None: ...

    async def elicit(self, message: str, requested_schema: dict[str, Any], *, key: str | None = None) -> ElicitAnswer:
        """Ask the client (form mode). ``key`` names the question where a wire lets the tool choose
        (a 2026-07-28 call asking before it becomes a task: the retry answers it by that key)."""
        ...

    async def log(self, level: str, data: Any, logger: str | None = None) -> None: ...

    async def status(self, message: str) -> None:
        """Say what the call is doing now, as its task's statusMessage on either wire (written at
        most once a second, the last one always; a call that is not a task has none)."""
        ...

    @property
    def durable(self) -> bool:
        """Whether a note (``remember``) outlives this process: the call runs as a task."""
        ...

    async def remember(self, note: dict[str, Any]) -> None:
        """Keep a small JSON object (at most 16 KiB) for the run that takes this task over if this
        process stops: an id at another service, a phase. A task with a note is run again after a
        takeover rather than failed, whatever the tool's ``rerunnable``, and its tool decides from
        ``recall()`` what to do. Outside a task the note lives as long as the call."""
        ...

    async def recall(self) -> dict[str, Any] | None:
        """The last note kept for this task (by this run or one before it), if any."""
        ...

    async def cancelled(self) -> bool:
        """After a CancelledError: whether the call itself was cancelled (its client's cancel, its
        task gone), rather than this run stopping while its task goes on in another process (a
        shutdown, a takeover). A tool that started work elsewhere stops that work only then."""
        ...

    async def sample(self, params: dict[str, Any], *, key: str | None = None) -> dict[str, Any]: ...

    async def list_roots(self, *, key: str | None = None) -> list[dict[str, Any]]:
        """The client's roots (needs the roots capability)."""
        ...


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}
