"""One tool call to its wire-neutral outcome: the tool's function called, what it returns or raises
normalised. Only the runtime's executor (``service.runtime.executor``) calls it: every plain call,
call inside its request and task run goes through there."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import orjson

from service.domain.task import FailureReason, Outcome, OutcomeKind
from service.tools.api import Refusal, ToolContext, ToolError, ToolFailure, text
from service.tools.registry import Registry, normalize_result

log = logging.getLogger(__name__)


def _without_nul(value: Any) -> Any:
    """PostgreSQL text and jsonb cannot hold U+0000; a tool's output keeps everything else."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    return value


def _scrubbed(payload: Any) -> Any:
    """``payload`` without U+0000, walked only when it holds one: orjson escapes it as \\u0000, and
    serialising is cheaper than the walk (a payload orjson refuses is walked all the same)."""
    try:
        if b"\\u0000" not in orjson.dumps(payload):
            return payload
    except TypeError:
        pass
    return _without_nul(payload)


def tool_outcome(value: Any) -> Outcome:
    payload = _scrubbed(normalize_result(value))
    kind = OutcomeKind.TOOL_ERROR if payload.get("isError") else OutcomeKind.RESULT
    return Outcome(kind, payload)


async def run_tool(registry: Registry, tool: str, arguments: dict[str, Any], ctx: ToolContext) -> Outcome:
    """Only cancellation propagates; an unexpected exception becomes an internal failure with a
    reference (its details go to the log, never to the client)."""
    spec = registry.tools.get(tool)
    if spec is None:
        return Outcome.failure(FailureReason.UNKNOWN_TOOL, f"unknown tool {tool!r}")
    try:
        return tool_outcome(await spec.fn(ctx, **arguments))
    except ToolError as exc:
        return Outcome(OutcomeKind.TOOL_ERROR, {"content": [text(_without_nul(str(exc)))], "isError": True})
    except ToolFailure as exc:
        return Outcome.failure(
            exc.reason if isinstance(exc, Refusal) else FailureReason.TOOL,
            _without_nul(exc.message),
            code=exc.code,
            data=_without_nul(exc.data),
        )
    except asyncio.CancelledError:
        raise
    except Exception:
        ref = secrets.token_hex(6)
        log.exception("tool %s raised (reference %s)", tool, ref)
        message = f"tool {tool!r} failed unexpectedly (reference {ref}); the operator's logs have the details"
        return Outcome.failure(FailureReason.INTERNAL, message)


def runner_stopped(tool: str) -> Outcome:
    return Outcome.failure(
        FailureReason.RUNNER_STOPPED,
        f"The runner executing tool {tool!r} stopped before the task finished (the process ended or "
        "lost its lease), and the tool is not marked safe to re-run. Start the task again.",
    )
