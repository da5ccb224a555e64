"""Plain (non-task) tools/call: in-flight registry, cancellation, and the tool's context."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable
from typing import Any

from service.mcp import jsonrpc
from service.tasks.signals import Signals
from service.tools.api import ElicitAnswer, RpcError
from service.tools.execute import parse_elicit_answer, parse_sample_answer, require_capability

# A plain call that asked the client for input gives up after this long without an answer.
PLAIN_INPUT_TIMEOUT_S = 600.0

CallKey = tuple[str, str, str]  # (tenant, session, repr of the request id)
AnswerKey = tuple[str, str, str]  # (tenant, subject, our request id): T-INPUT-7
# RFC 5424 severities, lowest first (LoggingLevel in the schema).
LOG_LEVELS = (
    "debug",
    "info",
    "notice",
    "warning",
    "error",
    "critical",
    "alert",
    "emergency",
)  # (tenant, session, request id as JSON)


class Inflight:
    """Plain calls running in this process, and their outstanding requests to the client."""

    def __init__(self, signals: Signals) -> None:
        self.signals = signals
        # Requests in flight here that notifications/cancelled may stop: key -> how to stop it.
        self.calls: dict[CallKey, Callable[[], object]] = {}
        self.pending: dict[AnswerKey, asyncio.Future[dict[str, Any]]] = {}
        signals.listen(self._on_signal)

    def _on_signal(self, kind: str, event: dict[str, Any]) -> None:
        tenant = str(event.get("t"))
        if kind == "rpc_response":
            self.resolve_local((tenant, str(event.get("sub")), str(event.get("rpc_id"))), event.get("answer") or {})
        elif kind == "cancel_request":
            self.cancel_local((tenant, str(event.get("s", "")), str(event.get("rid"))))

    def resolve_local(self, key: AnswerKey, answer: dict[str, Any]) -> bool:
        fut = self.pending.get(key)
        if fut is None or fut.done():
            return False
        fut.set_result(answer)
        return True

    def cancel_local(self, key: CallKey) -> bool:
        stop = self.calls.get(key)
        if stop is None:
            return False
        stop()
        return True

    async def answer(self, tenant: str, subject: str, rpc_id: str, answer: dict[str, Any]) -> None:
        if not self.resolve_local((tenant, subject, rpc_id), answer):
            await self.signals.publish("rpc_response", tenant, sub=subject, rpc_id=rpc_id, answer=answer)

    async def cancel(self, key: CallKey) -> None:
        """C-4: stop a plain request, here or on whichever replica runs it."""
        if not self.cancel_local(key):
            await self.signals.publish("cancel_request", key[0], s=key[1], rid=key[2])


class Outbox(asyncio.Queue[dict[str, Any]]):
    """The messages a plain call's tool sends before its result; ``first`` resolves on the first."""

    def __init__(self) -> None:
        super().__init__()
        self.first: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def put_nowait(self, item: dict[str, Any]) -> None:
        super().put_nowait(item)
        self.wake()

    def wake(self, _: object = None) -> None:
        if not self.first.done():
            self.first.set_result(None)


async def first_of(job: asyncio.Task[Any], outbox: Outbox) -> None:
    """Wait until the job ends or sends its first message: plain futures, no helper task."""
    if job.done() or outbox.first.done():
        return
    job.add_done_callback(outbox.wake)
    await outbox.first


class PlainCallContext:
    """A tool running inside its own tools/call request: messages go on that request's stream."""

    def __init__(
        self,
        inflight: Inflight,
        owner: tuple[str, str],
        outbox: asyncio.Queue[dict[str, Any]],
        *,
        progress_token: str | int | None,
        client_capabilities: dict[str, Any],
        log_level: str | None = None,
    ) -> None:
        self._inflight = inflight
        self._owner = owner
        self._outbox = outbox
        self._token = progress_token
        self._caps = client_capabilities
        self._min_log = LOG_LEVELS.index(log_level) if log_level in LOG_LEVELS else 0
        self._last_progress: float | None = None

    @property
    def task_id(self) -> str | None:
        return None

    async def progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        if self._token is None or (self._last_progress is not None and progress <= self._last_progress):
            return
        self._last_progress = progress
        params: dict[str, Any] = {"progressToken": self._token, "progress": progress}
        if total is not None:
            params["total"] = total
        if message is not None:
            params["message"] = message
        self._outbox.put_nowait(jsonrpc.notification("notifications/progress", params))

    async def log(self, level: str, data: Any, logger: str | None = None) -> None:
        if level not in LOG_LEVELS or LOG_LEVELS.index(level) < self._min_log:
            return
        params: dict[str, Any] = {"level": level, "data": data}
        if logger:
            params["logger"] = logger
        self._outbox.put_nowait(jsonrpc.notification("notifications/message", params))

    async def elicit(self, message: str, requested_schema: dict[str, Any]) -> ElicitAnswer:
        params = {"mode": "form", "message": message, "requestedSchema": requested_schema}
        return parse_elicit_answer(await self._ask("elicitation/create", params, needs="elicitation"))

    async def sample(self, params: dict[str, Any]) -> dict[str, Any]:
        return parse_sample_answer(await self._ask("sampling/createMessage", params, needs="sampling"))

    async def _ask(self, method: str, params: dict[str, Any], *, needs: str) -> dict[str, Any]:
        require_capability(self._caps, needs)
        rpc_id = f"req-{secrets.token_urlsafe(12)}"
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        key = (*self._owner, rpc_id)
        self._inflight.pending[key] = fut
        try:
            self._outbox.put_nowait(jsonrpc.request(rpc_id, method, params))
            try:
                return await asyncio.wait_for(fut, timeout=PLAIN_INPUT_TIMEOUT_S)
            except TimeoutError:
                raise RpcError(-32603, f"no answer from the client to {method} in time") from None
        finally:
            self._inflight.pending.pop(key, None)
            if not fut.done():
                with contextlib.suppress(Exception):
                    fut.cancel()
