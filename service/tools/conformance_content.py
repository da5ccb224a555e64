"""The conformance pack's 2025-11-25 fixtures that answer at once: content types, logging, errors,
progress, the resources and the prompts. The pack is created here; service.tools.conformance adds the rest."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from typing import Any

from service.tools.api import ToolContext, ToolError, text
from service.tools.registry import ToolPack

# One pack for every conformance fixture. These register first: the pack lists its tools in the order
# they were added, and the suite's order starts with them.
pack = ToolPack("conformance")

# A 1x1 red PNG.
PNG_1X1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="


def wav_base64() -> str:
    """A tenth of a second of 8 kHz silence."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(8000)
        w.writeframes(b"\x80" * 800)
    return base64.b64encode(buf.getvalue()).decode()


def image() -> dict[str, Any]:
    return {"type": "image", "data": PNG_1X1, "mimeType": "image/png"}


@pack.tool()
async def test_simple_text(ctx: ToolContext) -> str:
    """Returns a simple text response."""
    return "This is a simple text response for testing."


@pack.tool()
async def test_image_content(ctx: ToolContext) -> dict[str, Any]:
    """Returns a 1x1 PNG image."""
    return {"content": [image()]}


@pack.tool()
async def test_audio_content(ctx: ToolContext) -> dict[str, Any]:
    """Returns a short WAV clip."""
    return {"content": [{"type": "audio", "data": wav_base64(), "mimeType": "audio/wav"}]}


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
    return {"content": [text("Multiple content types test:"), image(), {"type": "resource", "resource": resource}]}


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
        {"role": "user", "content": image()},
        {"role": "user", "content": text("Please analyze the image above.")},
    ]
