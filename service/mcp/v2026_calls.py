"""2026-07-28 calls: tools/call as the request's declaration and the tool's policy allow (a call
inside its request, an input round, or a task, XD-5), and prompts that may ask the client first."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.types import Receive

from service.domain.errors import DomainError
from service.domain.events import LOG_LEVELS, LogEntry, Progress, TaskEvent
from service.domain.inputs import InputResponse, PendingInput
from service.domain.task import OutcomeKind, Wire
from service.mcp import jsonrpc
from service.mcp import v2026_wire as ext
from service.mcp.http import until_done_or_gone
from service.mcp.jsonrpc import INVALID_PARAMS, RequestId
from service.mcp.refusal import Refusal, from_domain
from service.mcp.v2025_wire import error_object, event_message
from service.mcp.v2026_request import (
    HTTP_400_CODES,
    Streamed,
    V2026Call,
    fail,
    header_value,
    object_param,
    string_param,
)
from service.tasks.service import CallMode, CallResult, TaskService

Core = Callable[[V2026Call, Receive], Awaitable[dict[str, Any]]]


class V2026Calls:
    def __init__(self, tasks: TaskService, *, grace_s: float, core: Core) -> None:
        """``core``: how a request the calls do not shape themselves is answered (a prompt that
        asks nothing is the core's prompts/get)."""
        self.tasks = tasks
        self.registry = tasks.registry
        self.grace_s = grace_s
        self._core = core

    async def tools_call(self, call: V2026Call, receive: Receive) -> dict[str, Any] | Streamed:
        """X-CREATE-*, XD-5: a tool's task policy and the request's declaration pick how it may end."""
        name = string_param(call.params, "name")
        arguments = object_param(call.params, "arguments") or {}
        spec = self.tasks.registry.get(name)
        self._check_param_headers(call, spec.input_schema, arguments)
        responses = self._with_state(call, name, arguments, responses_of(call.params.get("inputResponses")))
        if spec.task_support == "required":
            if not call.declaring:
                raise fail(
                    ext.MISSING_CAPABILITY,
                    f"tool {name!r} runs only as a task: declare the {ext.EXTENSION} extension",
                    {"requiredCapabilities": ext.REQUIRED_CAPABILITIES},
                    status=400,
                )  # X-NEG-7
            mode = CallMode.REQUIRED
        elif spec.task_support == "optional" and call.declaring:
            mode = CallMode.OPTIONAL
        else:
            mode = CallMode.SYNC  # X-NEG-5: never a task for a request that does not declare it
        meta = call.params["_meta"]
        token = meta.get("progressToken") if jsonrpc.valid_id(meta.get("progressToken")) else None
        if jsonrpc.id_too_long(token):
            raise fail(INVALID_PARAMS, f"_meta.progressToken is longer than {jsonrpc.MAX_ID_CHARS} characters")
        log_level = meta.get(ext.META_LOG_LEVEL) if meta.get(ext.META_LOG_LEVEL) in LOG_LEVELS else None
        events: asyncio.Queue[TaskEvent] = asyncio.Queue()
        streaming = token is not None or log_level is not None
        running = asyncio.ensure_future(
            self.tasks.call(
                call.caller,
                tool=name,
                arguments=arguments,
                mode=mode,
                responses=responses,
                progress_token=token,
                client_capabilities=call.capabilities,
                grace_s=self.grace_s,
                on_event=events.put_nowait if streaming else None,
            )
        )

        def answer(result: CallResult) -> dict[str, Any]:
            return self._call_answer(call, name, arguments, responses, result)

        if streaming:
            # XD-18: progress (and logs, at the level the request asked) of the part inside the
            # request go on its own SSE stream, then the answer; closing the stream cancels the call.
            return Streamed(_call_stream(call.request_id, running, events, log_level, answer))
        await until_done_or_gone(call.scope, receive, running)
        if not running.done():  # X-HTTP-7: the client closed the request, which cancels it
            running.cancel()
            with contextlib.suppress(BaseException):
                await running
            raise asyncio.CancelledError
        return answer(running.result())

    def _call_answer(
        self, call: V2026Call, name: str, arguments: dict[str, Any], responses: dict[str, InputResponse],
        result: CallResult,
    ) -> dict[str, Any]:  # fmt: skip
        if result.task is not None:
            return ext.created(result.task)
        if result.questions:
            return self._input_required(call, name, arguments, responses, result.questions, result.used)
        assert result.outcome is not None
        if result.outcome.kind is OutcomeKind.FAILURE:
            error = error_object(result.outcome)
            status = 400 if error["code"] in HTTP_400_CODES else 200
            raise fail(error["code"], error["message"], error.get("data"), status=status)
        payload = result.outcome.payload
        return {**ext.call_result(payload), "_meta": {**ext.server_meta(), **(payload.get("_meta") or {})}}

    async def prompts_get(self, call: V2026Call, receive: Receive) -> dict[str, Any]:
        """A prompt that may ask the client first answers like a tool call's round (SEP-2322)."""
        name = string_param(call.params, "name")
        prompt = self.registry.prompts.get(name)
        if prompt is None or not prompt.asks:
            return await self._core(call, receive)
        args = {k: str(v) for k, v in (object_param(call.params, "arguments") or {}).items()}
        responses = self._with_state(call, f"prompt:{name}", args, responses_of(call.params.get("inputResponses")))
        round_ = await self.tasks.ask_first(
            lambda ctx: prompt.render(args, ctx), responses=responses, client_capabilities=call.capabilities
        )
        if round_.questions:
            return self._input_required(call, f"prompt:{name}", args, responses, round_.questions, round_.used)
        out: dict[str, Any] = {"messages": round_.outcome}
        if prompt.description:
            out["description"] = prompt.description
        return ext.complete(out)

    def _input_required(
        self,
        call: V2026Call,
        bound_to: str,
        arguments: dict[str, Any],
        responses: dict[str, InputResponse],
        questions: tuple[PendingInput, ...],
        used: frozenset[str],
    ) -> dict[str, Any]:
        """InputRequiredResult: the questions, and the answers so far sealed in requestState (they
        travel with the client: nothing of the round stays here). Only the answers the run took are
        kept: keys it never asked for do not grow the state round after round."""
        stored = {k: r.to_stored() for k, r in responses.items() if k in used}
        state = self.tasks.request_states.seal(call.caller.principal, bound_to, arguments, stored)
        return {"resultType": "input_required", "inputRequests": ext.input_requests(questions),
                "requestState": state, "_meta": ext.server_meta()}  # fmt: skip

    def _with_state(
        self, call: V2026Call, bound_to: str, arguments: dict[str, Any], responses: dict[str, InputResponse]
    ) -> dict[str, InputResponse]:
        """The answers of earlier rounds, from a valid requestState, under this round's own."""
        state = call.params.get("requestState")
        if state is None:
            return responses
        if not isinstance(state, str):
            raise fail(INVALID_PARAMS, "params.requestState must be a string")
        earlier = self.tasks.request_states.open(call.caller.principal, bound_to, arguments, state)
        return {**{k: InputResponse.from_stored(v) for k, v in earlier.items() if isinstance(v, dict)}, **responses}

    def _check_param_headers(self, call: V2026Call, schema: dict[str, Any], arguments: dict[str, Any]) -> None:
        """X-HTTP-12: a parameter marked ``x-mcp-header`` is mirrored in ``Mcp-Param-<Name>``."""
        for prop, prop_schema in (schema.get("properties") or {}).items():
            header = prop_schema.get("x-mcp-header") if isinstance(prop_schema, dict) else None
            if not isinstance(header, str) or prop not in arguments:
                continue
            value = header_value(call.headers.get(f"mcp-param-{header.lower()}"))
            if value is None or value.strip() != str(arguments[prop]):
                raise fail(ext.HEADER_MISMATCH, f"Header mismatch: Mcp-Param-{header} must equal params.arguments.{prop}",
                            status=400)  # fmt: skip


def responses_of(raw: Any, *, lenient: bool = False) -> dict[str, InputResponse]:
    """``inputResponses`` as the core's answers. ``lenient``: a value that is not an object is
    kept as an empty answer, so a key nobody asked is ignored rather than refused (XD-9)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise fail(INVALID_PARAMS, "params.inputResponses must be an object")
    out: dict[str, InputResponse] = {}
    for key, value in raw.items():
        if not isinstance(value, dict):
            if not lenient:
                raise fail(INVALID_PARAMS, f"params.inputResponses[{key!r}] must be an object")
            value = {"invalid": value}
        out[key] = InputResponse(result=value)
    return out


async def _call_stream(
    request_id: RequestId,
    running: asyncio.Future[CallResult],
    events: asyncio.Queue[TaskEvent],
    log_level: str | None,
    answer: Callable[[CallResult], dict[str, Any]],
) -> AsyncIterator[dict[str, Any]]:
    try:
        while True:
            getter: asyncio.Future[TaskEvent] = asyncio.ensure_future(events.get())
            waiting: set[asyncio.Future[Any]] = {running, getter}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                message = _event_notification(getter.result(), log_level)
                if message is not None:
                    yield message
                continue
            getter.cancel()
            break
        while not events.empty():
            message = _event_notification(events.get_nowait(), log_level)
            if message is not None:
                yield message
        try:
            yield jsonrpc.result_message(request_id, answer(running.result()))
        except Refusal as failure:
            yield jsonrpc.error_message(request_id, failure.error_object())
        except DomainError as exc:
            yield jsonrpc.error_message(request_id, from_domain(exc, wire=Wire.V2026).error_object())
    finally:
        if not running.done():  # the client closed the stream: the call is cancelled (X-HTTP-7)
            running.cancel()
            with contextlib.suppress(BaseException):
                await running


def _event_notification(event: TaskEvent, log_level: str | None) -> dict[str, Any] | None:
    if isinstance(event, LogEntry) and log_level is None:
        return None  # no logs unless the request asked for them (its _meta logLevel)
    if isinstance(event, Progress | LogEntry):
        return event_message(event, None, log_level)
    return None
