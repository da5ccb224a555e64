"""The core speaks no wire (DESIGN.md §4): no JSON-RPC code, MCP method name or _meta key below mcp/.

The import rules of the same section are import-linter contracts (`make lint`); this test covers
what imports cannot show. The conformance fixture pack is exempt: its fixtures return literal shapes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "service"
CORE = ("tasks", "runtime", "tools", "domain")
EXEMPT = {ROOT / "tools" / "conformance.py"}

WIRE = re.compile(
    r"-32[0-9]{3}"  # JSON-RPC error codes
    r"|_meta"  # the MCP metadata object
    r"|io\.modelcontextprotocol/"  # reserved _meta keys and extension ids
    r"|\bjsonrpc\b"
    r"|\b(?:tools|tasks|resources|prompts|notifications|elicitation|sampling|roots|logging|completion"
    r"|subscriptions|server)/[a-zA-Z]"  # method names
    r"|\binitialize\b"
)


def wire_mentions(path: Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if WIRE.search(line)
    ]


@pytest.mark.parametrize("package", CORE)
def test_the_core_builds_no_wire_shapes(package: str) -> None:
    found = [
        hit for path in sorted((ROOT / package).rglob("*.py")) if path not in EXEMPT for hit in wire_mentions(path)
    ]
    assert found == [], "wire shapes belong in service/mcp:\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_wire_shape() -> None:
    """The pattern is not vacuous: a code, a _meta key, a method name and a reserved key are caught."""
    for line in ('code = -32602', 'params["_meta"] = {}', 'method = "notifications/progress"',
                 'RELATED = "io.modelcontextprotocol/related-task"', 'send("tasks/result")'):  # fmt: skip
        assert WIRE.search(line), line
