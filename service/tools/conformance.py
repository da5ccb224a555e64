"""Conformance fixture pack (off by default): the tools, resources and prompts the official MCP
conformance suite's server scenarios call by name. Enable with MCP_TASKS_TOOLS=...,service.tools.conformance.

The second half holds the fixtures of the 2026-07-28 runs (the ``tasks-*`` scenarios of the Tasks
extension and the generic scenarios ``--requirements 2026-07-28`` adds); docs/ext-conformance-notes.md
says what each scenario sends and expects of them."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from collections.abc import Awaitable
from typing import Any, TypeVar

from service.tools.api import ElicitAnswer, InputNotSupported, RpcError, ToolContext, ToolError, ToolFailure, text
from service.tools.registry import ToolPack

pack = ToolPack("conformance")
T = TypeVar("T")

# A 1x1 red PNG.
PNG_1X1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="


def _wav_base64() -> str:
    """A tenth of a second of 8 kHz silence."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(8000)
        w.writeframes(b"\x80" * 800)
    return base64.b64encode(buf.getvalue()).decode()


def _image() -> dict[str, Any]:
    return {"type": "image", "data": PNG_1X1, "mimeType": "image/png"}


@pack.tool()
async def test_simple_text(ctx: ToolContext) -> str:
    """Returns a simple text response."""
    return "This is a simple text response for testing."


@pack.tool()
async def test_image_content(ctx: ToolContext) -> dict[str, Any]:
    """Returns a 1x1 PNG image."""
    return {"content": [_image()]}


@pack.tool()
async def test_audio_content(ctx: ToolContext) -> dict[str, Any]:
    """Returns a short WAV clip."""
    return {"content": [{"type": "audio", "data": _wav_base64(), "mimeType": "audio/wav"}]}


@pack.tool()
async def test_embedded_resource(ctx: ToolContext) -> dict[str, Any]:
    """Returns an embedded text resource."""
    resource = {
        "uri": "test://embedded-resource",
        "mimeType": "text/plain",
        "text": "This is an embedded resource content.",
    }
    return {"content": [{"type": "resource", "resource": resource}]}


@pack.tool()
async def test_multiple_content_types(ctx: ToolContext) -> dict[str, Any]:
    """Returns text, an image and an embedded resource."""
    resource = {
        "uri": "test://mixed-content-resource",
        "mimeType": "application/json",
        "text": json.dumps({"test": "data", "value": 123}, separators=(",", ":")),
    }
    return {"content": [text("Multiple content types test:"), _image(), {"type": "resource", "resource": resource}]}


@pack.tool()
async def test_tool_with_logging(ctx: ToolContext) -> str:
    """Sends three log notifications while it runs."""
    await ctx.log("info", "Tool execution started")
    await asyncio.sleep(0.05)
    await ctx.log("info", "Tool processing data")
    await asyncio.sleep(0.05)
    await ctx.log("info", "Tool execution completed")
    return "Tool with logging executed successfully"


@pack.tool()
async def test_error_handling(ctx: ToolContext) -> str:
    """Always returns a tool error."""
    raise ToolError("This tool intentionally returns an error for testing")


@pack.tool()
async def test_tool_with_progress(ctx: ToolContext) -> str:
    """Reports progress 0, 50 and 100 of 100."""
    for step, value in enumerate((0, 50, 100)):
        if step:
            await asyncio.sleep(0.05)
        await ctx.progress(value, 100)
    return "Tool with progress completed"


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


@pack.resource("test://static-text", name="static-text", mime_type="text/plain", description="A static text resource")
async def static_text(uri: str) -> list[dict[str, Any]]:
    return [{"uri": uri, "mimeType": "text/plain", "text": "This is the content of the static text resource."}]


@pack.resource("test://static-binary", name="static-binary", mime_type="image/png", description="A static PNG")
async def static_binary(uri: str) -> list[dict[str, Any]]:
    return [{"uri": uri, "mimeType": "image/png", "blob": PNG_1X1}]


@pack.resource("test://watched-resource", name="watched-resource", mime_type="text/plain", description="Subscribable")
async def watched(uri: str) -> list[dict[str, Any]]:
    return [{"uri": uri, "mimeType": "text/plain", "text": "Watched resource content."}]


@pack.resource("test://template/{id}/data", name="template-data", mime_type="application/json", description="By id")
async def template_data(uri: str) -> list[dict[str, Any]]:
    item = uri.removeprefix("test://template/").removesuffix("/data")
    body = json.dumps({"id": item, "templateTest": True, "data": f"Data for ID: {item}"})
    return [{"uri": uri, "mimeType": "application/json", "text": body}]


@pack.prompt("test_simple_prompt", description="A simple prompt without arguments")
async def simple_prompt(args: dict[str, str]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text("This is a simple prompt for testing.")}]


@pack.prompt(
    "test_prompt_with_arguments",
    description="A prompt with two required arguments",
    arguments=[
        {"name": "arg1", "description": "First test argument", "required": True},
        {"name": "arg2", "description": "Second test argument", "required": True},
    ],
)
async def prompt_with_arguments(args: dict[str, str]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text(f"Prompt with arguments: arg1='{args['arg1']}', arg2='{args['arg2']}'")}]


@pack.prompt(
    "test_prompt_with_embedded_resource",
    description="A prompt that embeds a resource",
    arguments=[{"name": "resourceUri", "description": "URI of the resource to embed", "required": True}],
)
async def prompt_with_resource(args: dict[str, str]) -> list[dict[str, Any]]:
    resource = {"uri": args["resourceUri"], "mimeType": "text/plain", "text": "Embedded resource content for testing."}
    return [
        {"role": "user", "content": {"type": "resource", "resource": resource}},
        {"role": "user", "content": text("Please process the embedded resource above.")},
    ]


@pack.prompt("test_prompt_with_image", description="A prompt that includes an image")
async def prompt_with_image(args: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": _image()},
        {"role": "user", "content": text("Please analyze the image above.")},
    ]


# --- 2026-07-28: fixtures of the Tasks extension scenarios (tasks-*) ---------------------------------
#
# Input keys. The scenarios read most keys from inputRequests, but the MRTR scenarios need keys the
# tool chooses and that stay the same on every round (an answer keyed "user_name" may arrive on the
# first call, without requestState). Each question below names its key (ctx.elicit(..., key=...)).

ASK_AFTER_S = 1.0
"""confirm_delete and multi_input ask only after this long, so their first tools/call outlives the
synchronous grace and returns a task (tasks-mrtr-input wants a taskId); test_tool_with_task asks at
once, so its first tools/call is answered with the MRTR round (tasks-mrtr-composition)."""


def _form(**properties: str) -> dict[str, Any]:
    """A requestedSchema of required primitive fields: name -> JSON type."""
    return {
        "type": "object",
        "properties": {name: {"type": kind} for name, kind in properties.items()},
        "required": list(properties),
    }


async def _elicit(ctx: ToolContext, key: str, message: str, schema: dict[str, Any]) -> ElicitAnswer:
    """Ask one form question under ``key`` (the retried call answers it by that key)."""
    return await ctx.elicit(message, schema, key=key)


async def _sample(ctx: ToolContext, key: str, question: str, max_tokens: int) -> str:
    params = {"messages": [{"role": "user", "content": text(question)}], "maxTokens": max_tokens}
    content = (await ctx.sample(params, key=key)).get("content")
    return str(content.get("text", "")) if isinstance(content, dict) else ""


async def _roots(ctx: ToolContext, key: str) -> list[dict[str, Any]]:
    """The client's roots."""
    return await ctx.list_roots(key=key)


async def _together(*asks: Awaitable[T]) -> list[T]:
    """Ask at once (asyncio.gather); if one fails, withdraw the others before re-raising."""
    tasks = [asyncio.ensure_future(ask) for ask in asks]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _content(answer: ElicitAnswer) -> dict[str, Any]:
    return (answer.content or {}) if answer.action == "accept" else {}


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
    answer = await _elicit(ctx, "confirm", f"Delete {filename}?", _form(confirm="boolean"))
    if _content(answer).get("confirm") is True:
        return f"Deleted {filename}"
    return f"Kept {filename} (action={answer.action})"


@pack.tool()
async def multi_input(ctx: ToolContext) -> str:
    """Asks two questions at once; completes when both are answered."""
    await asyncio.sleep(ASK_AFTER_S)
    name, proceed = await _together(
        _elicit(ctx, "name", "Your name?", _form(name="string")),
        _elicit(ctx, "confirm", "Proceed?", _form(confirm="boolean")),
    )
    return f"multi_input done: name={_content(name).get('name')!r} confirm={_content(proceed).get('confirm')!r}"


@pack.tool(task_support="required")
async def test_tool_with_task(ctx: ToolContext) -> str:
    """Asks for the user's name first, then works a second as a task; the result names the user."""
    answer = await _elicit(ctx, "user_name", "What is your name?", _form(name="string"))
    name = _content(answer).get("name")
    await asyncio.sleep(1.0)
    return f"Task finished for {name}" if name else f"Task finished without a name (action={answer.action})"


# --- 2026-07-28: fixtures of the generic scenarios (server-stateless, input-required-result-*, ...) ---


@pack.tool(task_support="forbidden")
async def test_missing_capability(ctx: ToolContext) -> str:
    """Needs sampling; called without it, refuses with the missing client capability."""
    try:
        answer = await _sample(ctx, "question", "Say hello", 20)
    except InputNotSupported as exc:
        raise RpcError(-32021, str(exc), {"requiredCapabilities": {"sampling": {}}}) from None
    return f"LLM response: {answer}"


@pack.tool(task_support="forbidden")
async def test_streaming_elicitation(ctx: ToolContext) -> str:
    """Asks one question at once (the answer must come back by the request's retry, not a stream)."""
    answer = await _elicit(ctx, "confirm", "Continue the streaming test?", _form(ok="boolean"))
    return f"Elicitation completed: {_elicited(answer.action, answer.content)}"


@pack.tool(task_support="forbidden")
async def test_logging_tool(ctx: ToolContext) -> str:
    """Logs one message and returns at once."""
    await ctx.log("info", "test_logging_tool ran")
    return "Logging tool executed"


@pack.tool(task_support="forbidden")
async def test_input_required_result_elicitation(ctx: ToolContext) -> str:
    """Asks the user's name (key user_name), then greets."""
    answer = await _elicit(ctx, "user_name", "What is your name?", _form(name="string"))
    return f"Hello, {_content(answer).get('name', 'stranger')}!"


@pack.tool(task_support="forbidden")
async def test_input_required_result_sampling(ctx: ToolContext) -> str:
    """Asks the client's model a question (key capital_question) and returns its answer."""
    return "LLM response: " + await _sample(ctx, "capital_question", "What is the capital of France?", 100)


@pack.tool(task_support="forbidden")
async def test_input_required_result_list_roots(ctx: ToolContext) -> str:
    """Asks the client for its roots (key client_roots) and lists them."""
    roots = await _roots(ctx, "client_roots")
    return "Roots: " + ", ".join(str(r.get("uri")) for r in roots)


@pack.tool(task_support="forbidden")
async def test_input_required_result_request_state(ctx: ToolContext) -> str:
    """Asks for a confirmation (key confirm); the answer arrives with the round's requestState."""
    answer = await _elicit(ctx, "confirm", "Please confirm", _form(ok="boolean"))
    return f"state-ok: confirmed={_content(answer).get('ok')!r}"


@pack.tool(task_support="forbidden")
async def test_input_required_result_multiple_inputs(ctx: ToolContext) -> str:
    """Asks three kinds of question at once: a name, a model greeting and the client's roots."""
    asked: list[Any] = await _together(
        _elicit(ctx, "user_name", "What is your name?", _form(name="string")),
        _sample(ctx, "greeting", "Generate a greeting", 50),
        _roots(ctx, "client_roots"),
    )
    answer, greeting, roots = asked
    return f"name={_content(answer).get('name')!r} greeting={greeting!r} roots={len(roots)}"


@pack.tool(task_support="forbidden")
async def test_input_required_result_multi_round(ctx: ToolContext) -> str:
    """Asks two questions one after the other (keys step1, step2)."""
    first = await _elicit(ctx, "step1", "Step 1: What is your name?", _form(name="string"))
    second = await _elicit(ctx, "step2", "Step 2: What is your favorite color?", _form(color="string"))
    return f"name={_content(first).get('name')!r} color={_content(second).get('color')!r}"


@pack.tool(task_support="forbidden")
async def test_input_required_result_tampered_state(ctx: ToolContext) -> str:
    """Asks for a confirmation (key confirm); a retry with altered requestState must be refused."""
    answer = await _elicit(ctx, "confirm", "Please confirm", _form(ok="boolean"))
    return f"confirmed={_content(answer).get('ok')!r}"


@pack.tool(task_support="forbidden")
async def test_input_required_result_capabilities(ctx: ToolContext) -> str:
    """Asks only what the request declared: a name (elicitation) and a model answer (sampling)."""
    outcomes = await asyncio.gather(
        _elicit(ctx, "user_name", "What is your name?", _form(name="string")),
        _sample(ctx, "capital_question", "What is the capital of France?", 100),
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
    answer = await _elicit(ctx, "user_context", "What context should the prompt use?", _form(context="string"))
    context = _content(answer).get("context", "")
    return [{"role": "user", "content": text(f"Prompt with context: {context}")}]
