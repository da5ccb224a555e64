"""Conformance fixture pack (off by default): the tools, resources and prompts the official MCP
conformance suite's server scenarios call by name. Enable with MCP_TASKS_TOOLS=...,service.tools.conformance.

The pack starts in service.tools.conformance_content (the 2025-11-25 fixtures that answer at once);
this module adds, in the suite's order, the 2025-11-25 fixtures that ask the client and the fixtures
of the 2026-07-28 runs (the ``tasks-*`` scenarios of the Tasks extension and the generic scenarios
``--requirements 2026-07-28`` adds); docs/ext-conformance-notes.md says what each scenario sends and
expects of them. Fixtures whose descriptions or errors spell wire shapes stay in this module, the one
tests/test_architecture.py exempts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from service.tools import conformance_asks as ask
from service.tools.api import InputNotSupported, RpcError, ToolContext, ToolError, ToolFailure, text
from service.tools.conformance_content import pack

__all__ = ["pack"]


@pack.tool()
async def test_sampling(ctx: ToolContext, prompt: str) -> str:
    """Asks the client's model to answer the prompt (sampling/createMessage)."""
    result = await ctx.sample({"messages": [{"role": "user", "content": text(prompt)}], "maxTokens": 100})
    content = result.get("content")
    answer = content.get("text", "") if isinstance(content, dict) else ""
    return f"LLM response: {answer}"


def _elicited(action: str, content: dict[str, Any] | None) -> str:
    return f"action={action}, content={json.dumps(content or {})}"


@pack.tool()
async def test_elicitation(ctx: ToolContext, message: str) -> str:
    """Asks the user for a username and an email (elicitation/create)."""
    schema = {
        "type": "object",
        "properties": {
            "username": {"type": "string", "description": "User's response"},
            "email": {"type": "string", "description": "User's email address"},
        },
        "required": ["username", "email"],
    }
    answer = await ctx.elicit(message, schema)
    return f"User response: {_elicited(answer.action, answer.content)}"


@pack.tool()
async def test_elicitation_sep1034_defaults(ctx: ToolContext) -> str:
    """Elicits fields that carry default values (SEP-1034)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "description": "User name", "default": "John Doe"},
            "age": {"type": "integer", "description": "User age", "default": 30},
            "score": {"type": "number", "description": "User score", "default": 95.5},
            "status": {
                "type": "string",
                "description": "User status",
                "enum": ["active", "inactive", "pending"],
                "default": "active",
            },
            "verified": {"type": "boolean", "description": "Verification status", "default": True},
        },
    }
    answer = await ctx.elicit("Please review and update the form fields with defaults", schema)
    return f"Elicitation completed: {_elicited(answer.action, answer.content)}"


@pack.tool()
async def test_elicitation_sep1330_enums(ctx: ToolContext) -> str:
    """Elicits every enum form of SEP-1330."""
    schema = {
        "type": "object",
        "properties": {
            "untitledSingle": {"type": "string", "enum": ["option1", "option2", "option3"]},
            "titledSingle": {
                "type": "string",
                "oneOf": [
                    {"const": "value1", "title": "First Option"},
                    {"const": "value2", "title": "Second Option"},
                    {"const": "value3", "title": "Third Option"},
                ],
            },
            "legacyEnum": {
                "type": "string",
                "enum": ["opt1", "opt2", "opt3"],
                "enumNames": ["Option One", "Option Two", "Option Three"],
            },
            "untitledMulti": {"type": "array", "items": {"type": "string", "enum": ["option1", "option2", "option3"]}},
            "titledMulti": {
                "type": "array",
                "items": {
                    "anyOf": [
                        {"const": "value1", "title": "First Choice"},
                        {"const": "value2", "title": "Second Choice"},
                        {"const": "value3", "title": "Third Choice"},
                    ]
                },
            },
        },
    }
    answer = await ctx.elicit("Please select options from the enum fields", schema)
    return f"Elicitation completed: {_elicited(answer.action, answer.content)}"


JSON_SCHEMA_2020_12: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {
        "address": {
            "$anchor": "addressDef",
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
        }
    },
    "properties": {
        "name": {"type": "string"},
        "address": {"$ref": "#/$defs/address"},
        "contactMethod": {"type": "string", "enum": ["phone", "email"]},
        "phone": {"type": "string"},
        "email": {"type": "string"},
    },
    "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
    "if": {"properties": {"contactMethod": {"const": "phone"}}, "required": ["contactMethod"]},
    "then": {"required": ["phone"]},
    "else": {"required": ["email"]},
    "additionalProperties": False,
}


@pack.tool(
    name="json_schema_2020_12_tool",
    description="Tool with JSON Schema 2020-12 features",
    input_schema=JSON_SCHEMA_2020_12,
)
async def json_schema_2020_12_tool(ctx: ToolContext, **arguments: Any) -> str:
    return "received " + json.dumps(arguments, sort_keys=True)


# --- 2026-07-28: fixtures of the Tasks extension scenarios (tasks-*) ---------------------------------
#
# Input keys. The scenarios read most keys from inputRequests, but the MRTR scenarios need keys the
# tool chooses and that stay the same on every round (an answer keyed "user_name" may arrive on the
# first call, without requestState). Each question below names its key (ctx.elicit(..., key=...)).

ASK_AFTER_S = 1.0
"""confirm_delete and multi_input ask only after this long, so their first tools/call outlives the
synchronous grace and returns a task (tasks-mrtr-input wants a taskId); test_tool_with_task asks at
once, so its first tools/call is answered with the MRTR round (tasks-mrtr-composition)."""


async def _cancellable_sleep(seconds: float) -> None:
    if not 0 <= seconds <= 86_400:  # also refuses NaN
        raise ToolError("seconds must be a number between 0 and 86400")
    await asyncio.sleep(seconds)


@pack.tool(task_support="forbidden", rerunnable=True)
async def greet(ctx: ToolContext, name: str) -> str:
    """Greets by name at once (never a task)."""
    return f"Hello, {name}!"


@pack.tool(rerunnable=True)
async def slow_compute(ctx: ToolContext, seconds: float = 1.0, label: str = "") -> str:
    """Sleeps the given seconds (cancellable), then reports what it computed."""
    await _cancellable_sleep(seconds)
    return f"Computed {label or 'result'} after {seconds:g}s"


@pack.tool(task_support="required", rerunnable=True)
async def failing_job(ctx: ToolContext) -> str:
    """Runs about a second, then ends with a tool error (isError: true)."""
    await asyncio.sleep(1.0)
    raise ToolError("failing_job: the job failed on purpose")


@pack.tool(task_support="required", rerunnable=True)
async def protocol_error_job(ctx: ToolContext) -> str:
    """Runs about a second, then fails with a protocol error (no result)."""
    await asyncio.sleep(1.0)
    raise ToolFailure("protocol_error_job: internal failure on purpose")


@pack.tool()
async def confirm_delete(ctx: ToolContext, filename: str) -> str:
    """Asks the client to confirm deleting a file (one elicitation), then reports what it did."""
    await asyncio.sleep(ASK_AFTER_S)
    answer = await ask.elicit(ctx, "confirm", f"Delete {filename}?", ask.form(confirm="boolean"))
    if ask.accepted(answer).get("confirm") is True:
        return f"Deleted {filename}"
    return f"Kept {filename} (action={answer.action})"


@pack.tool()
async def multi_input(ctx: ToolContext) -> str:
    """Asks two questions at once; completes when both are answered."""
    await asyncio.sleep(ASK_AFTER_S)
    name, proceed = await ask.together(
        ask.elicit(ctx, "name", "Your name?", ask.form(name="string")),
        ask.elicit(ctx, "confirm", "Proceed?", ask.form(confirm="boolean")),
    )
    return f"multi_input done: name={ask.accepted(name).get('name')!r} confirm={ask.accepted(proceed).get('confirm')!r}"


@pack.tool(task_support="required")
async def test_tool_with_task(ctx: ToolContext) -> str:
    """Asks for the user's name first, then works a second as a task; the result names the user."""
    answer = await ask.elicit(ctx, "user_name", "What is your name?", ask.form(name="string"))
    name = ask.accepted(answer).get("name")
    await asyncio.sleep(1.0)
    return f"Task finished for {name}" if name else f"Task finished without a name (action={answer.action})"


# --- 2026-07-28: fixtures of the generic scenarios (server-stateless, input-required-result-*, ...) ---


@pack.tool(task_support="forbidden")
async def test_missing_capability(ctx: ToolContext) -> str:
    """Needs sampling; called without it, refuses with the missing client capability."""
    try:
        answer = await ask.sample(ctx, "question", "Say hello", 20)
    except InputNotSupported as exc:
        raise RpcError(-32021, str(exc), {"requiredCapabilities": {"sampling": {}}}) from None
    return f"LLM response: {answer}"


@pack.tool(task_support="forbidden")
async def test_streaming_elicitation(ctx: ToolContext) -> str:
    """Asks one question at once (the answer must come back by the request's retry, not a stream)."""
    answer = await ask.elicit(ctx, "confirm", "Continue the streaming test?", ask.form(ok="boolean"))
    return f"Elicitation completed: {_elicited(answer.action, answer.content)}"


@pack.tool(task_support="forbidden")
async def test_logging_tool(ctx: ToolContext) -> str:
    """Logs one message and returns at once."""
    await ctx.log("info", "test_logging_tool ran")
    return "Logging tool executed"


@pack.tool(task_support="forbidden")
async def test_input_required_result_elicitation(ctx: ToolContext) -> str:
    """Asks the user's name (key user_name), then greets."""
    answer = await ask.elicit(ctx, "user_name", "What is your name?", ask.form(name="string"))
    return f"Hello, {ask.accepted(answer).get('name', 'stranger')}!"


@pack.tool(task_support="forbidden")
async def test_input_required_result_sampling(ctx: ToolContext) -> str:
    """Asks the client's model a question (key capital_question) and returns its answer."""
    return "LLM response: " + await ask.sample(ctx, "capital_question", "What is the capital of France?", 100)


@pack.tool(task_support="forbidden")
async def test_input_required_result_list_roots(ctx: ToolContext) -> str:
    """Asks the client for its roots (key client_roots) and lists them."""
    roots = await ask.roots(ctx, "client_roots")
    return "Roots: " + ", ".join(str(r.get("uri")) for r in roots)


@pack.tool(task_support="forbidden")
async def test_input_required_result_request_state(ctx: ToolContext) -> str:
    """Asks for a confirmation (key confirm); the answer arrives with the round's requestState."""
    answer = await ask.elicit(ctx, "confirm", "Please confirm", ask.form(ok="boolean"))
    return f"state-ok: confirmed={ask.accepted(answer).get('ok')!r}"


@pack.tool(task_support="forbidden")
async def test_input_required_result_multiple_inputs(ctx: ToolContext) -> str:
    """Asks three kinds of question at once: a name, a model greeting and the client's roots."""
    asked: list[Any] = await ask.together(
        ask.elicit(ctx, "user_name", "What is your name?", ask.form(name="string")),
        ask.sample(ctx, "greeting", "Generate a greeting", 50),
        ask.roots(ctx, "client_roots"),
    )
    answer, greeting, roots = asked
    return f"name={ask.accepted(answer).get('name')!r} greeting={greeting!r} roots={len(roots)}"


@pack.tool(task_support="forbidden")
async def test_input_required_result_multi_round(ctx: ToolContext) -> str:
    """Asks two questions one after the other (keys step1, step2)."""
    first = await ask.elicit(ctx, "step1", "Step 1: What is your name?", ask.form(name="string"))
    second = await ask.elicit(ctx, "step2", "Step 2: What is your favorite color?", ask.form(color="string"))
    return f"name={ask.accepted(first).get('name')!r} color={ask.accepted(second).get('color')!r}"


@pack.tool(task_support="forbidden")
async def test_input_required_result_tampered_state(ctx: ToolContext) -> str:
    """Asks for a confirmation (key confirm); a retry with altered requestState must be refused."""
    answer = await ask.elicit(ctx, "confirm", "Please confirm", ask.form(ok="boolean"))
    return f"confirmed={ask.accepted(answer).get('ok')!r}"


@pack.tool(task_support="forbidden")
async def test_input_required_result_capabilities(ctx: ToolContext) -> str:
    """Asks only what the request declared: a name (elicitation) and a model answer (sampling)."""
    outcomes = await asyncio.gather(
        ask.elicit(ctx, "user_name", "What is your name?", ask.form(name="string")),
        ask.sample(ctx, "capital_question", "What is the capital of France?", 100),
        return_exceptions=True,
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, InputNotSupported):
            raise outcome
    asked = [o for o in outcomes if not isinstance(o, BaseException)]
    return f"answered {len(asked)} of {len(outcomes)} questions the client could take"


CUSTOM_HEADERS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"region": {"type": "string", "description": "Mirrored as a header", "x-mcp-header": "Region"}},
    "required": ["region"],
}


@pack.tool(
    name="test_custom_headers",
    task_support="forbidden",
    description="A tool whose region argument is mirrored into the Mcp-Param-Region header",
    input_schema=CUSTOM_HEADERS_SCHEMA,
)
async def test_custom_headers(ctx: ToolContext, **arguments: Any) -> str:
    return f"region={arguments.get('region')!r}"


@pack.prompt(
    "test_input_required_result_prompt",
    description="A prompt that asks the client for context first (multi-round-trip, SEP-2322)",
    asks=True,
)
async def input_required_prompt(args: dict[str, str], ctx: ToolContext) -> list[dict[str, Any]]:
    answer = await ask.elicit(ctx, "user_context", "What context should the prompt use?", ask.form(context="string"))
    context = ask.accepted(answer).get("context", "")
    return [{"role": "user", "content": text(f"Prompt with context: {context}")}]
