"""Run one tool call to its wire-neutral outcome; shared by task runners and plain calls."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from service.domain.task import Outcome, OutcomeKind
from service.tools.api import ElicitAnswer, InputNotSupported, RpcError, ToolContext, ToolError, text
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


def tool_outcome(value: Any) -> Outcome:
    payload = _without_nul(normalize_result(value))
    kind = OutcomeKind.TOOL_ERROR if payload.get("isError") else OutcomeKind.RESULT
    return Outcome(kind, payload)


async def run_tool(registry: Registry, tool: str, arguments: dict[str, Any], ctx: ToolContext) -> Outcome:
    """Only cancellation propagates; an unexpected exception becomes a -32603 with a reference
    (its details go to the log, never to the client)."""
    spec = registry.tools.get(tool)
    if spec is None:
        return Outcome(OutcomeKind.RPC_ERROR, {"code": -32602, "message": f"unknown tool {tool!r}"})
    try:
        return tool_outcome(await spec.fn(ctx, **arguments))
    except ToolError as exc:
        return Outcome(OutcomeKind.TOOL_ERROR, {"content": [text(_without_nul(str(exc)))], "isError": True})
    except RpcError as exc:
        return Outcome(OutcomeKind.RPC_ERROR, _without_nul(exc.to_wire()))
    except asyncio.CancelledError:
        raise
    except Exception:
        ref = secrets.token_hex(6)
        log.exception("tool %s raised (reference %s)", tool, ref)
        message = f"tool {tool!r} failed unexpectedly (reference {ref}); the operator's logs have the details"
        return Outcome(OutcomeKind.RPC_ERROR, {"code": -32603, "message": message})


def supports_form_elicitation(capabilities: dict[str, Any]) -> bool:
    """T-CAP-8: an empty elicitation object means form mode; otherwise form must be listed."""
    elicitation = capabilities.get("elicitation")
    return isinstance(elicitation, dict) and (not elicitation or "form" in elicitation)


def require_capability(capabilities: dict[str, Any], needs: str) -> None:
    """A tool may only ask the client for what the client declared (T-CAP-8, D-6)."""
    if needs == "elicitation" and not supports_form_elicitation(capabilities):
        raise InputNotSupported(
            "this tool needs form elicitation, but the client did not declare it in capabilities.elicitation; "
            "call it from a client that supports form elicitation"
        )
    if needs not in capabilities:
        raise InputNotSupported(
            f"this tool needs {needs} from the client, but the client did not declare the {needs!r} capability; "
            f"call it from a client that supports {needs}"
        )


def parse_sample_answer(answer: dict[str, Any]) -> dict[str, Any]:
    """A client's JSON-RPC response to sampling/createMessage, as the tool sees it."""
    result = answer.get("result")
    if "error" in answer or not isinstance(result, dict):
        raise RpcError(-32603, "the client refused the sampling request")
    return result


def parse_elicit_answer(answer: dict[str, Any]) -> ElicitAnswer:
    """A client's JSON-RPC response to elicitation/create, as the tool sees it."""
    if "error" in answer:
        err = answer["error"] if isinstance(answer["error"], dict) else {}
        code = err.get("code")
        raise RpcError(
            code if isinstance(code, int) and not isinstance(code, bool) else -32603,
            f"the client refused the elicitation: {err.get('message', 'no message')}",
        )
    result = answer.get("result")
    if not isinstance(result, dict) or result.get("action") not in ("accept", "decline", "cancel"):
        raise RpcError(-32602, "the client answered the elicitation with an invalid ElicitResult")
    content = result.get("content")
    return ElicitAnswer(result["action"], content if isinstance(content, dict) else None)


def runner_stopped_error(tool: str) -> dict[str, Any]:
    return {
        "code": -32603,
        "message": (
            f"The runner executing tool {tool!r} stopped before the task finished (the process ended or "
            "lost its lease), and the tool is not marked safe to re-run. Start the task again."
        ),
    }
