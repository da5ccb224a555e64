"""TaskRunContext: what a tool running as a task may do (progress, elicitation, logging)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

from service.domain.task import RELATED_TASK, Task, TaskStatus
from service.store import repository as repo
from service.store.db import Database
from service.store.events import EventHub, notify
from service.tools.api import ElicitAnswer
from service.tools.execute import parse_elicit_answer, parse_sample_answer, require_capability


class TaskRunContext:
    """Bound to one claimed task and the runner that holds its lease."""

    def __init__(self, task: Task, *, owner: str, db: Database, hub: EventHub, poll_s: float) -> None:
        self._task = task
        self._owner = owner
        self._db = db
        self._hub = hub
        self._poll_s = poll_s
        self._last_progress: float | None = None

    @property
    def task_id(self) -> str | None:
        return self._task.task_id

    async def progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        """T-PROG-1/3: reuse the creating request's token; drop values that do not increase."""
        if self._task.progress_token is None:
            return
        if self._last_progress is not None and progress <= self._last_progress:
            return
        self._last_progress = progress
        params: dict[str, Any] = {"progressToken": self._task.progress_token, "progress": progress}
        if total is not None:
            params["total"] = total
        if message is not None:
            params["message"] = message
        params["_meta"] = {RELATED_TASK: {"taskId": self._task.task_id}}
        event = self._event("progress", params)
        with contextlib.suppress(Exception):  # progress is best effort (P-2)
            await self._hub.publish(self._db.pool, event)

    async def log(self, level: str, data: Any, logger: str | None = None) -> None:
        params: dict[str, Any] = {"level": level, "data": data}
        if logger:
            params["logger"] = logger
        params["_meta"] = {RELATED_TASK: {"taskId": self._task.task_id}}
        event = self._event("log", params)
        with contextlib.suppress(Exception):
            await self._hub.publish(self._db.pool, event)

    def _event(self, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        t = self._task
        return {"k": kind, "t": t.tenant_id, "id": t.task_id, "s": t.session_id, "params": params}

    async def elicit(self, message: str, requested_schema: dict[str, Any]) -> ElicitAnswer:
        params = {
            "mode": "form",
            "message": message,
            "requestedSchema": requested_schema,
            "_meta": {RELATED_TASK: {"taskId": self._task.task_id}},
        }
        return parse_elicit_answer(await self._ask("elicitation/create", params, needs="elicitation"))

    async def sample(self, params: dict[str, Any]) -> dict[str, Any]:
        params = {**params, "_meta": {RELATED_TASK: {"taskId": self._task.task_id}}}
        return parse_sample_answer(await self._ask("sampling/createMessage", params, needs="sampling"))

    async def _ask(self, method: str, params: dict[str, Any], *, needs: str) -> dict[str, Any]:
        """Queue a request for the client, go input_required, wait for the answer, go working."""
        require_capability(self._task.client_capabilities, needs)
        t = self._task
        rpc_id = f"task-{secrets.token_urlsafe(12)}"
        async with self._hub.subscribe(("task", t.tenant_id, t.task_id)) as events:
            async with self._db.transaction() as conn:
                seq = await repo.insert_message(conn, t.tenant_id, t.task_id, rpc_id, method, params)
                moved = await repo.set_active_status(
                    conn, t.tenant_id, t.task_id, self._owner, TaskStatus.INPUT_REQUIRED, "waiting for input"
                )
                if moved is None:
                    raise asyncio.CancelledError  # cancelled or lease lost under us
                await notify(conn, {"k": "status", "t": t.tenant_id, "id": t.task_id, "s": t.session_id})
            while True:
                async with self._db.connection() as conn:
                    answer = await repo.get_answer(conn, t.tenant_id, t.task_id, seq)
                if answer is not None:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(events.get(), timeout=self._poll_s)
        async with self._db.transaction() as conn:
            moved = await repo.set_active_status(conn, t.tenant_id, t.task_id, self._owner, TaskStatus.WORKING, None)
            if moved is None:
                raise asyncio.CancelledError
            await notify(conn, {"k": "status", "t": t.tenant_id, "id": t.task_id, "s": t.session_id})
        return answer
