"""Value objects (service/domain/values.py): frozen to the type checker, plain dataclasses at run time."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from mypy import api as mypy_api

from service.domain.principal import Principal
from service.domain.values import frozen

ROOT = Path(__file__).resolve().parents[1]


@frozen
class _Pair:
    left: str
    right: int = 0


def test_a_value_is_equal_and_hashable_by_value_and_replaced_by_a_copy() -> None:
    a, b = _Pair("x", 1), _Pair("x", 1)
    assert a == b
    assert hash(a) == hash(b)
    assert {a: 1}[b] == 1
    changed = dataclasses.replace(a, right=2)
    assert changed == _Pair("x", 2)
    assert a.right == 1
    assert not hasattr(a, "__dict__")  # slotted: no stray attributes


def test_the_service_declares_its_values_one_way() -> None:
    """Every frozen dataclass of the service is a ``frozen`` value, so that one rule (the type
    checker's) guards them all; `@dataclass(frozen=True, slots=True)` costs five times as much to build."""
    pattern = re.compile(r"^\s*@dataclass\(frozen=True, slots=True\)")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "service").rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_the_type_checker_refuses_a_change_to_a_value(tmp_path: Path) -> None:
    """What frozen=True enforced at run time, mypy (strict, on service/ in CI) enforces on the code."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        "from service.domain.principal import Principal\ndef f(p: Principal) -> None:\n    p.tenant_id = 'another'\n"
    )
    out, _, status = mypy_api.run(["--strict", "--cache-dir", str(tmp_path / "cache"), str(snippet)])
    assert status == 1
    assert 'Property "tenant_id" defined in "Principal" is read-only' in out
    assert Principal("t", "s").tenant_id == "t"
