"""A call of an upstream tool over the 2026-07-28 wire, declaring the Tasks extension: the upstream
answers at once (``complete``), asks first (``input_required``, MRTR: asked of our client and
sent again with the answers), or makes the call a task of its own (``task``). Its task id is kept
with ours (``ToolContext.remember``) and followed with ``tasks/get`` at its ``pollIntervalMs``:
status messages become ours, its ``inputRequests`` go to our client and their answers back with
``tasks/update``, its inline result or error is our outcome. Our cancel, a timeout or a failure
sends ``tasks/cancel``; a shutdown or takeover does not, and the next run follows the same task.

A task of this wire is bound to the credentials that created it (ours, the same in every process
of ours), not to a session: any of our processes can follow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Final

import httpx
import pydantic
from mcp import types

from service.tools.api import ToolContext, ToolFailure
from service.tools.context import progress_text
from service.upstream.auth import UpstreamAuthError
from service.upstream.calls import RESULT_KEYS, CallAsker, UpstreamFailure, following
from service.upstream.config import UpstreamConfig
from service.upstream.connection import describe
from service.upstream.modern import PROTOCOL, BadAnswer, Modern, ModernError, SilentUpstream

POLL_BOUNDS_S: Final = (0.1, 10.0)
MAX_ROUNDS: Final = 16  # MRTR rounds of one tools/call before the upstream makes up its mind


class ExtCall:
    """One of our calls of ``tool`` on a 2026-07-28 upstream, as its task when it makes one."""

    def __init__(
        self, modern: Modern, config: UpstreamConfig, tool: str, ctx: ToolContext, forward: dict[str, str]
    ) -> None:
        self.modern = modern
        self.config = config
        self.tool = tool
        self.ctx = ctx
        self.forward = forward
        self.label = f"upstream {config.name!r} (tool {tool!r})"
        self.asker = CallAsker(ctx, asyncio.get_running_loop())
        self.deadline = time.monotonic() + config.timeout_s
        self.last_message: str | None = None
        self.reported = 0
        self.answered: set[str] = set()

    async def run(self, arguments: dict[str, Any], note: dict[str, Any] | None) -> dict[str, Any]:
        try:
            started = await self._start(arguments, note)
            if "taskId" not in started:
                return _call_result(started)
            task_id = str(started["taskId"])
            return await following(self.ctx, task_id, self._follow(task_id, started), self._cancel)
        finally:
            self.asker.end()

    async def _start(self, arguments: dict[str, Any], note: dict[str, Any] | None) -> dict[str, Any]:
        """The task a run before this one created (as tasks/get shows it), or the answer to a new call."""
        if note is not None and isinstance(note.get("upstream_task"), str):
            task_id: str = note["upstream_task"]
            try:
                return await self._request("tasks/get", {"taskId": task_id}, name=task_id)
            except UpstreamFailure as exc:
                if not self.config.rerunnable:
                    raise UpstreamFailure(
                        f"{self.label}: our process stopped while it followed the upstream's task {task_id}, and "
                        f"the upstream no longer shows it ({exc.message}). Start the task again.",
                        breaks=False,
                    ) from None
        elif note is not None and note.get("phase") == "creating" and not self.config.rerunnable:
            raise UpstreamFailure(
                f"{self.label}: our process stopped while it called the upstream, which may have started the "
                "tool there. Start the task again.",
                breaks=False,
            )
        await self.ctx.remember({"upstream": self.config.name, "wire": PROTOCOL, "phase": "creating"})
        params: dict[str, Any] = {"name": self.tool, "arguments": arguments}
        for _ in range(MAX_ROUNDS):
            answer = await self._request("tools/call", params, name=self.tool, meta={"progressToken": 1})
            if answer.get("resultType") == "task" and isinstance(answer.get("taskId"), str):
                await self._keep(answer["taskId"])
                return answer
            if answer.get("resultType") != "input_required":
                return answer
            # MRTR: the upstream asks before it decides; the call goes again with the answers.
            params = {"name": self.tool, "arguments": arguments}
            if answer.get("inputRequests"):
                params["inputResponses"] = await self._answers(answer["inputRequests"])
            elif not isinstance(answer.get("requestState"), str):
                raise UpstreamFailure(f"{self.label} asked for input but named no question", breaks=True)
            if isinstance(answer.get("requestState"), str):
                params["requestState"] = answer["requestState"]
        raise UpstreamFailure(f"{self.label} asked {MAX_ROUNDS} rounds of questions without an answer", breaks=False)

    async def _keep(self, task_id: str) -> None:
        try:
            await self.ctx.remember({"upstream": self.config.name, "wire": PROTOCOL, "upstream_task": task_id})
        except BaseException:  # not kept (our lease went): nobody could follow it, so it stops
            await self._cancel(task_id)
            raise

    async def _follow(self, task_id: str, task: dict[str, Any]) -> dict[str, Any]:
        while True:
            status = task.get("status")
            await self._relay(task.get("statusMessage"))
            if status == "completed":
                return _call_result(task.get("result"))
            if status == "failed":
                error: dict[str, Any] = task["error"] if isinstance(task.get("error"), dict) else {}
                raise UpstreamFailure(
                    f"{self.label} failed its task: error {error.get('code')}: {str(error.get('message'))[:500]}",
                    breaks=False,
                )
            if status == "cancelled":
                raise UpstreamFailure(f"{self.label}: the upstream cancelled its task {task_id}", breaks=False)
            pending = task.get("inputRequests") if status == "input_required" else None
            fresh = {k: v for k, v in pending.items() if k not in self.answered} if isinstance(pending, dict) else {}
            if fresh:  # questions not answered yet: answered now, and the task read again at once
                answers = await self._answers(fresh)
                await self._request("tasks/update", {"taskId": task_id, "inputResponses": answers}, name=task_id)
                self.answered.update(answers)
            else:
                low, high = POLL_BOUNDS_S
                interval = task.get("pollIntervalMs")
                await asyncio.sleep(min(high, max(low, (interval if isinstance(interval, int) else 1000) / 1000)))
            task = await self._request("tasks/get", {"taskId": task_id}, name=task_id)

    async def _answers(self, requests: Any) -> dict[str, Any]:
        """Each question of the upstream, asked of our client; the answers by key. A question our
        client cannot answer ends the call (this wire has no error answer to a question)."""
        if not isinstance(requests, dict):
            raise UpstreamFailure(f"{self.label} asked for input in a form that is not MCP", breaks=True)
        answers: dict[str, Any] = {}
        for key, request in requests.items():
            method = request.get("method") if isinstance(request, dict) else None
            params = request.get("params") if isinstance(request, dict) else None
            answer = await self._ask(method, params if isinstance(params, dict) else {})
            if isinstance(answer, types.ErrorData):
                raise self.asker.failure or UpstreamFailure(
                    f"{self.label} asked {method}, which cannot be answered here: {answer.message}", breaks=False
                )
            answers[str(key)] = answer.model_dump(by_alias=True, exclude_none=True, mode="json")
        return answers

    async def _ask(self, method: Any, params: dict[str, Any]) -> Any:
        try:
            if method == "elicitation/create":
                return await self.asker.elicit(types.ElicitRequestFormParams.model_validate(params))
            if method == "sampling/createMessage":
                return await self.asker.sample(types.CreateMessageRequestParams.model_validate(params))
            if method == "roots/list":
                return await self.asker.roots()
        except pydantic.ValidationError:
            raise UpstreamFailure(
                f"{self.label} asked {method} with parameters that are not MCP", breaks=True
            ) from None
        raise UpstreamFailure(f"{self.label} asked {method!r}, which is no question of MCP", breaks=True)

    async def _relay(self, message: Any) -> None:
        """A changed status message of the upstream task is ours, and progress to whoever asked for it."""
        if isinstance(message, str) and message and message != self.last_message:
            self.last_message = message
            self.reported += 1
            await self.ctx.status(message)
            await self.ctx.progress(self.reported, None, message)

    async def _progress(self, message: dict[str, Any]) -> None:
        """Progress of the call while it runs inside its request (before it becomes a task)."""
        params = message.get("params")
        if message.get("method") == "notifications/progress" and isinstance(params, dict):
            progress, total, text = params.get("progress"), params.get("total"), params.get("message")
            if isinstance(progress, int | float):
                total = total if isinstance(total, int | float) else None
                text = text if isinstance(text, str) else None
                await self.ctx.progress(progress, total, text)
                await self.ctx.status(progress_text(progress, total, text))

    async def _request(
        self, method: str, params: dict[str, Any], *, name: str, meta: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One request, bounded by ``idle_timeout_s`` per message and what is left of ``timeout_s``."""
        if self.deadline - time.monotonic() <= 0:
            raise UpstreamFailure(
                f"{self.label} did not finish within timeout_s={self.config.timeout_s:g} s: it was cancelled",
                breaks=False,
            )
        try:
            return await self.modern.request(
                method, params, name=name, forward=self.forward, idle_s=self.config.idle_timeout_s,
                deadline=self.deadline, meta=meta, on_notification=self._progress,
            )  # fmt: skip
        except SilentUpstream:
            if self.deadline - time.monotonic() <= 0.01:
                raise UpstreamFailure(
                    f"{self.label} did not finish within timeout_s={self.config.timeout_s:g} s: it was cancelled",
                    breaks=False,
                ) from None
            raise UpstreamFailure(
                f"{self.label} sent nothing for idle_timeout_s={self.config.idle_timeout_s:g} s: it was cancelled",
                breaks=True,
            ) from None
        except ModernError as exc:
            raise UpstreamFailure(f"{self.label} answered {method} with error {exc.code}: {exc.message}",
                                  breaks=False) from None  # fmt: skip
        except BadAnswer as exc:
            raise UpstreamFailure(f"{self.label} answered {method} with {exc}", breaks=True) from None
        except httpx.HTTPError as exc:
            raise UpstreamFailure(f"{self.label} could not be reached for {method}: {describe(exc)}",
                                  breaks=True) from None  # fmt: skip
        except UpstreamAuthError as exc:  # our credentials for it (an empty variable, a token endpoint down)
            raise UpstreamFailure(f"{self.label} could not be called ({method}): {exc}", breaks=True) from None
        except (asyncio.CancelledError, ToolFailure):
            raise

    async def _cancel(self, task_id: str) -> None:
        """We stopped following: the upstream task stops too (best effort, bounded)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.shield(self.modern.request(
                    "tasks/cancel", {"taskId": task_id}, name=task_id, forward=self.forward, idle_s=2,
                    deadline=time.monotonic() + 2,
                )),
                2,
            )  # fmt: skip


def _call_result(result: Any) -> dict[str, Any]:
    """The CallToolResult keys of an answer (its _meta and resultType are the upstream's)."""
    if not isinstance(result, dict) or not isinstance(result.get("content", []), list):
        raise UpstreamFailure("the upstream answered with something that is not a CallToolResult", breaks=True)
    return {k: result[k] for k in RESULT_KEYS if k in result}
