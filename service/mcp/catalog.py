"""Resources, prompts and completion, for tool packs that define them: the same on both wires
(the 2026-07-28 wire renders the answers in its own form)."""

from __future__ import annotations

from typing import Any

from service.domain.errors import InvalidArguments
from service.mcp.jsonrpc import INVALID_PARAMS
from service.mcp.refusal import Refusal, from_domain
from service.tools.registry import Registry

RESOURCE_NOT_FOUND = -32002
Reply = dict[str, Any]


def _str_param(params: dict[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str):
        raise Refusal(INVALID_PARAMS, f"params.{name} must be a string" if name in params else f"missing params.{name}")
    return value


class Catalog:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def resources_list(self, params: dict[str, Any]) -> Reply:
        return {"resources": [r.to_wire() for r in self.registry.resources if not r.template]}

    async def resource_templates_list(self, params: dict[str, Any]) -> Reply:
        return {"resourceTemplates": [r.to_wire() for r in self.registry.resources if r.template]}

    async def resources_read(self, params: dict[str, Any]) -> Reply:
        uri = _str_param(params, "uri")
        for spec in self.registry.resources:
            if spec.uri == uri or (spec.template and _template_matches(spec.uri, uri)):
                return {"contents": await spec.read(uri)}
        raise Refusal(RESOURCE_NOT_FOUND, f"resource not found: {uri}", {"uri": uri})

    async def prompts_list(self, params: dict[str, Any]) -> Reply:
        return {"prompts": [p.to_wire() for p in self.registry.prompts.values()]}

    async def prompts_get(self, params: dict[str, Any]) -> Reply:
        name = _str_param(params, "name")
        prompt = self.registry.prompts.get(name)
        if prompt is None:
            raise Refusal(INVALID_PARAMS, f"unknown prompt {name!r}")
        args = params.get("arguments") or {}
        if not isinstance(args, dict):
            raise Refusal(INVALID_PARAMS, "params.arguments must be an object")
        missing = [a["name"] for a in prompt.arguments if a.get("required") and a["name"] not in args]
        if missing:
            raise from_domain(InvalidArguments(f"missing prompt arguments: {', '.join(missing)}"))
        if prompt.asks:
            raise Refusal(INVALID_PARAMS, f"prompt {name!r} asks the client first: get it over 2026-07-28")
        out: dict[str, Any] = {"messages": await prompt.render({k: str(v) for k, v in args.items()})}
        if prompt.description:
            out["description"] = prompt.description
        return out

    async def completion_complete(self, params: dict[str, Any]) -> Reply:
        return {"completion": {"values": [], "total": 0, "hasMore": False}}


def _template_matches(template: str, uri: str) -> bool:
    prefix = template.split("{", 1)[0]
    return uri.startswith(prefix) and len(uri) > len(prefix)
