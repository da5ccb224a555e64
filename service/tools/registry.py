"""Tool packs register tools (and resources and prompts); the registry validates and dispatches."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import field
from typing import Any, Literal, get_type_hints

import orjson
import pydantic

from service.domain.errors import InvalidArguments, UnknownTool
from service.domain.values import frozen
from service.tools.api import ToolContext, ToolResult, text

TaskSupport = Literal["forbidden", "optional", "required"]
ToolFn = Callable[..., Awaitable[Any]]


@frozen
class ToolSpec:
    name: str
    fn: ToolFn
    description: str
    input_schema: dict[str, Any]
    task_support: TaskSupport
    rerunnable: bool
    output_schema: dict[str, Any] | None = None
    title: str | None = None
    annotations: dict[str, Any] | None = None
    model: type[pydantic.BaseModel] | None = None
    # Bumped by the pack's author when tasks accepted for the old version must not run on the new
    # one (arguments or meaning changed): a runner claims a task only with the version it was
    # accepted for (docs/decisions.md, "Tool versions"). None: any runner with the tool will do.
    version: str | None = None
    # The most one task of this tool may run, in seconds, counted from its first start across
    # takeovers; None: the operator's MCP_TASKS_MAX_RUNTIME_S, which is also the ceiling.
    max_runtime_s: float | None = None
    # Where the tool lives when not in a pack, for the audit record: {"upstream": name,
    # "upstream_tool": its name there} (service.upstream).
    origin: dict[str, str] | None = None
    # Whether a call inside its request (2026-07-28) may answer its questions by running again from
    # the start with the answers (MRTR). False for an upstream's tool: running it again would call
    # the upstream again, so such a call becomes a task before it asks (service.runtime.inline).
    replays: bool = True

    def runtime_limit_s(self, ceiling_s: float) -> float:
        """The limit its tasks run under, given the operator's default and ceiling."""
        return ceiling_s if self.max_runtime_s is None else min(self.max_runtime_s, ceiling_s)

    def to_wire(self, *, with_execution: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        }
        if self.title:
            out["title"] = self.title
        if self.output_schema is not None:
            out["outputSchema"] = self.output_schema
        if self.annotations:
            out["annotations"] = self.annotations
        if with_execution:
            out["execution"] = {"taskSupport": self.task_support}
        return out

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Schema-level validation (D-15: a failure is a protocol error, no task is created)."""
        if self.model is None:
            _check_required(self.name, self.input_schema, arguments)
            return arguments
        try:
            # model_validate(...).model_dump() without their Python wrappers (the same defaults)
            model = self.model
            return model.__pydantic_serializer__.to_python(model.__pydantic_validator__.validate_python(arguments))  # type: ignore[no-any-return]
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}" for e in exc.errors()
            )
            raise InvalidArguments(f"invalid arguments for tool {self.name!r}: {problems}") from None


def _check_required(name: str, schema: dict[str, Any], arguments: dict[str, Any]) -> None:
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        raise InvalidArguments(f"invalid arguments for tool {name!r}: missing {', '.join(missing)}")


@frozen
class ResourceSpec:
    uri: str
    name: str
    read: Callable[[str], Awaitable[list[dict[str, Any]]]]
    mime_type: str | None = None
    description: str | None = None
    template: bool = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"uriTemplate" if self.template else "uri": self.uri, "name": self.name}
        if self.mime_type:
            out["mimeType"] = self.mime_type
        if self.description:
            out["description"] = self.description
        return out


@frozen
class PromptSpec:
    name: str
    render: Callable[..., Awaitable[list[dict[str, Any]]]]
    description: str | None = None
    arguments: list[dict[str, Any]] = field(default_factory=list)
    # render(args, ctx): the prompt may ask the client first (2026-07-28 multi-round-trip requests).
    asks: bool = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "arguments": self.arguments}
        if self.description:
            out["description"] = self.description
        return out


def _model_for(fn: ToolFn) -> tuple[type[pydantic.BaseModel], dict[str, Any]]:
    """Input model and JSON schema from the function's type hints (all parameters but ``ctx``)."""
    hints = get_type_hints(fn)
    fields: dict[str, Any] = {}
    for pname, param in list(inspect.signature(fn).parameters.items())[1:]:
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (hints.get(pname, Any), default)
    model = pydantic.create_model(f"{fn.__name__}_arguments", __config__=pydantic.ConfigDict(extra="ignore"), **fields)
    schema = model.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    schema.setdefault("properties", {})
    return model, schema


class ToolPack:
    """A named group of tools, resources and prompts, defined in an ordinary module."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tools: list[ToolSpec] = []
        self.resources: list[ResourceSpec] = []
        self.prompts: list[PromptSpec] = []

    def tool(
        self,
        *,
        name: str | None = None,
        description: str | None = None,
        task_support: TaskSupport = "optional",
        rerunnable: bool = False,
        input_schema: dict[str, Any] | None = None,
        output_schema: dict[str, Any] | None = None,
        title: str | None = None,
        annotations: dict[str, Any] | None = None,
        version: str | None = None,
        max_runtime_s: float | None = None,
    ) -> Callable[[ToolFn], ToolFn]:
        """``max_runtime_s``: the most one task of the tool may run (the operator's
        MCP_TASKS_MAX_RUNTIME_S when None, and never above it: a pack that declares more is refused
        at start)."""
        if version is not None and not version.strip():
            raise ValueError("a tool's version is a non-empty string, or None for an unversioned tool")
        if max_runtime_s is not None and not max_runtime_s > 0:
            raise ValueError("a tool's max_runtime_s is a number of seconds above 0, or None for the operator's")

        def register(fn: ToolFn) -> ToolFn:
            model: type[pydantic.BaseModel] | None = None
            schema = input_schema
            if schema is None:
                model, schema = _model_for(fn)
            self.tools.append(
                ToolSpec(
                    name=name or fn.__name__,
                    fn=fn,
                    description=description or inspect.getdoc(fn) or "",
                    input_schema=schema,
                    task_support=task_support,
                    rerunnable=rerunnable,
                    output_schema=output_schema,
                    title=title,
                    annotations=annotations,
                    model=model,
                    version=version,
                    max_runtime_s=max_runtime_s,
                )
            )
            return fn

        return register

    def resource(
        self, uri: str, *, name: str, mime_type: str | None = None, description: str | None = None
    ) -> Callable[[Callable[[str], Awaitable[list[dict[str, Any]]]]], Any]:
        def register(fn: Callable[[str], Awaitable[list[dict[str, Any]]]]) -> Any:
            template = "{" in uri
            self.resources.append(ResourceSpec(uri, name, fn, mime_type, description, template))
            return fn

        return register

    def prompt(
        self,
        name: str,
        *,
        description: str | None = None,
        arguments: list[dict[str, Any]] | None = None,
        asks: bool = False,
    ) -> Callable[[Callable[..., Awaitable[list[dict[str, Any]]]]], Any]:
        """``asks``: the function is ``render(args, ctx)`` and may ask the client through ``ctx``."""

        def register(fn: Callable[..., Awaitable[list[dict[str, Any]]]]) -> Any:
            self.prompts.append(PromptSpec(name, fn, description, arguments or [], asks))
            return fn

        return register


class Registry:
    """All loaded packs, by name, and the tools of other sources (upstream MCP servers), which
    come and go while the process runs: ``set_tools`` replaces a source's tools, and each of
    ``listeners`` is called after a change (the runner publishes what it can run again)."""

    def __init__(self, packs: list[ToolPack]) -> None:
        self.tools: dict[str, ToolSpec] = {}
        self.listeners: list[Callable[[], None]] = []
        # Whether the tools may change while the process runs (there are upstreams): what the
        # server's tools.listChanged capability says.
        self.may_change = False
        self._sources: dict[str, frozenset[str]] = {}  # source → the names of its tools
        self.resources: list[ResourceSpec] = []
        self.prompts: dict[str, PromptSpec] = {}
        for pack in packs:
            for spec in pack.tools:
                if spec.name in self.tools:
                    raise ValueError(f"tool {spec.name!r} is defined by two packs")
                self.tools[spec.name] = spec
            self.resources.extend(pack.resources)
            for prompt in pack.prompts:
                self.prompts[prompt.name] = prompt

    @classmethod
    def load(cls, references: list[str], *, max_runtime_s: float | None = None) -> Registry:
        """``module`` (its ``pack`` attribute) or ``module:attr``, as in MCP_TASKS_TOOLS.
        ``max_runtime_s``: the operator's ceiling (MCP_TASKS_MAX_RUNTIME_S), checked for every tool."""
        packs: list[ToolPack] = []
        for ref in references:
            module_name, _, attr = ref.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                raise ValueError(f"cannot import tool pack {ref!r}: {exc}") from exc
            pack = getattr(module, attr or "pack", None)
            if not isinstance(pack, ToolPack):
                raise ValueError(f"tool pack {ref!r} has no ToolPack named {attr or 'pack'!r}")
            packs.append(pack)
        registry = cls(packs)
        if max_runtime_s is not None:
            registry.check_runtime_limits(max_runtime_s)
        return registry

    def check_runtime_limits(self, ceiling_s: float) -> None:
        """Refuse a tool that declares a runtime limit above the operator's ceiling: it would be
        cut short of what its pack promises, so the operator decides (raise the ceiling, or the pack
        declares less)."""
        for spec in self.tools.values():
            if spec.max_runtime_s is not None and spec.max_runtime_s > ceiling_s:
                raise ValueError(
                    f"tool {spec.name!r} declares max_runtime_s={spec.max_runtime_s:g}, above the ceiling "
                    f"MCP_TASKS_MAX_RUNTIME_S={ceiling_s:g}: raise MCP_TASKS_MAX_RUNTIME_S or lower the tool's limit"
                )

    def set_tools(self, source: str, specs: list[ToolSpec]) -> None:
        """``source``'s tools are now ``specs`` (none: it has none now). A new dict, so that a
        reader walking the old one is not disturbed."""
        old = self._sources.get(source, frozenset())
        tools = {name: spec for name, spec in self.tools.items() if name not in old}
        for spec in specs:
            if spec.name in tools:
                raise ValueError(f"tool {spec.name!r} of {source} is already defined")
            tools[spec.name] = spec
        self.tools = tools
        self._sources[source] = frozenset(spec.name for spec in specs)
        for listener in self.listeners:
            listener()

    def get(self, name: str) -> ToolSpec:
        spec = self.tools.get(name)
        if spec is None:
            raise UnknownTool(f"unknown tool {name!r}; list the tools to see the available ones")
        return spec


def normalize_result(value: Any) -> dict[str, Any]:
    """A tool's return value as a CallToolResult dict."""
    if isinstance(value, ToolResult):
        return value.to_wire()
    if isinstance(value, str):
        return {"content": [text(value)]}
    if isinstance(value, dict) and "content" in value:
        return value
    if value is None:
        return {"content": []}
    structured = value if isinstance(value, dict) else {"result": value}
    return {"content": [text(orjson.dumps(value).decode())], "structuredContent": structured}


__all__ = ["Registry", "ToolContext", "ToolPack", "ToolSpec", "normalize_result"]
