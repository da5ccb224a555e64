"""The 2026-07-28 conformance fixtures (docs/ext-conformance-notes.md §4): names, task policies and
what each returns for the answers the suite gives. A fake context stands in for the service."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from service.tools import conformance
from service.tools.api import ElicitAnswer, InputNotSupported, RpcError, ToolError, ToolFailure
from service.tools.registry import Registry, normalize_result
from service.tools.registry import ToolSpec as Spec


class FakeContext:
    """Answers every question at once; records what was asked. ``declared`` names the capabilities."""

    def __init__(self, answer: dict[str, Any] | None = None, declared: tuple[str, ...] = ("elicitation", "sampling")):
        self.answer = answer or {}
        self.declared = declared
        self.asked: list[tuple[str, Any]] = []
        self.keys: list[str | None] = []
        self.logs: list[Any] = []

    @property
    def task_id(self) -> str | None:
        return None

    async def progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        return None

    async def elicit(self, message: str, requested_schema: dict[str, Any], *, key: str | None = None) -> ElicitAnswer:
        if "elicitation" not in self.declared:
            raise InputNotSupported("no elicitation")
        self.asked.append(("elicitation", message))
        self.keys.append(key)
        return ElicitAnswer("accept", dict(self.answer))

    async def log(self, level: str, data: Any, logger: str | None = None) -> None:
        self.logs.append(data)

    async def sample(self, params: dict[str, Any], *, key: str | None = None) -> dict[str, Any]:
        if "sampling" not in self.declared:
            raise InputNotSupported("no sampling")
        self.asked.append(("sampling", params["messages"][0]["content"]["text"]))
        self.keys.append(key)
        return {"role": "assistant", "content": {"type": "text", "text": "Paris"}, "model": "m"}

    async def list_roots(self, *, key: str | None = None) -> list[dict[str, Any]]:
        self.asked.append(("roots", None))
        self.keys.append(key)
        return [{"uri": "file:///test/root", "name": "Test Root"}]


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    async def sleep(seconds: float) -> None:
        return None

    monkeypatch.setattr(
        conformance, "asyncio", SimpleNamespace(sleep=sleep, gather=asyncio.gather, ensure_future=asyncio.ensure_future)
    )


def spec(name: str) -> Spec:
    return Registry([conformance.pack]).get(name)


async def run(tool: str, ctx: FakeContext, **arguments: Any) -> str:
    value = await spec(tool).fn(ctx, **spec(tool).validate(arguments))
    return str(normalize_result(value)["content"][0]["text"])


@pytest.mark.parametrize(
    ("name", "policy"),
    [
        ("greet", "forbidden"),
        ("slow_compute", "optional"),
        ("failing_job", "required"),
        ("protocol_error_job", "required"),
        ("confirm_delete", "optional"),
        ("multi_input", "optional"),
        ("test_tool_with_task", "required"),
        ("test_missing_capability", "forbidden"),
        ("test_input_required_result_elicitation", "forbidden"),
        ("test_custom_headers", "forbidden"),
    ],
)
def test_policy(name: str, policy: str) -> None:
    assert spec(name).task_support == policy
    assert spec(name).description


async def test_greet_and_slow_compute() -> None:
    assert await run("greet", FakeContext(), name="sep-2243") == "Hello, sep-2243!"
    assert await run("slow_compute", FakeContext(), seconds=0, label="instant") == "Computed instant after 0s"
    with pytest.raises(ToolError):
        await run("slow_compute", FakeContext(), seconds=-1)


async def test_failing_and_protocol_error_jobs() -> None:
    with pytest.raises(ToolError):
        await run("failing_job", FakeContext())
    with pytest.raises(ToolFailure) as failure:
        await run("protocol_error_job", FakeContext())
    assert not isinstance(failure.value, ToolError)


async def test_input_fixtures_use_the_answers_the_suite_gives() -> None:
    assert await run("confirm_delete", FakeContext({"confirm": True}), filename="a.txt") == "Deleted a.txt"
    ctx = FakeContext({"name": "partial-1", "confirm": True})
    assert await run("multi_input", ctx) == "multi_input done: name='partial-1' confirm=True"
    assert len(ctx.asked) == 2
    assert "Alice" in await run("test_tool_with_task", FakeContext({"name": "Alice"}))
    assert await run("test_input_required_result_elicitation", FakeContext({"name": "Alice"})) == "Hello, Alice!"
    assert "state-ok" in await run("test_input_required_result_request_state", FakeContext({"ok": True}))
    multi = FakeContext({"name": "Alice"})
    assert await run("test_input_required_result_multi_round", multi) == "name='Alice' color=None"
    assert [m for _, m in multi.asked] == ["Step 1: What is your name?", "Step 2: What is your favorite color?"]


async def test_missing_capability_names_sampling() -> None:
    with pytest.raises(RpcError) as refused:
        await run("test_missing_capability", FakeContext(declared=()))
    assert refused.value.data == {"requiredCapabilities": {"sampling": {}}}


async def test_questions_asked_together_are_withdrawn_when_one_fails() -> None:
    ctx = FakeContext(declared=("sampling",))
    with pytest.raises(InputNotSupported):
        await run("test_input_required_result_multiple_inputs", ctx)


async def test_capabilities_fixture_asks_only_what_was_declared() -> None:
    ctx = FakeContext(declared=("sampling",))
    await run("test_input_required_result_capabilities", ctx)
    assert [kind for kind, _ in ctx.asked] == ["sampling"]


async def test_custom_headers_schema_marks_region() -> None:
    assert spec("test_custom_headers").input_schema["properties"]["region"]["x-mcp-header"] == "Region"
    assert await run("test_custom_headers", FakeContext(), region="Hello") == "region='Hello'"
